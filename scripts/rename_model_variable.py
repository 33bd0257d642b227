"""Rename the loaded model adapter's variable, parameter and attribute from ``qwen`` to
``model`` (the adapter serves every family, not only Qwen's).

    python scripts/rename_model_variable.py            # rewrite the files, list what changed
    python scripts/rename_model_variable.py --check    # list only; exit 1 if anything is left

What it renames, in the git-tracked ``.py`` files under apbv/, tests/, benchmarks/ and
scripts/: every Python name token ``qwen`` (variables, parameters, keyword arguments,
``self.qwen`` and ``engine.qwen`` attributes, fixtures), and ``qwen.<attr>`` inside strings
where it is code (``{qwen.family}`` in an f-string, ````qwen.extra_levels```` in a docstring).
Family names and other strings (``qwen-vl-utils``, ``qwen.tiktoken``, ``qwen2_5_vl``) are
not names and stay. :data:`SKIP` lists files where ``qwen`` names something else.

Lines continued under an opening bracket that moved are re-aligned with it. It refuses
(exit 2, nothing written) where ``model`` already names something in a scope that also uses
``qwen`` (a function, a class's ``self`` attributes, a module's top-level names), and lists
the lines the rename makes longer than 100 characters for a hand fix. Running it again
changes nothing.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

OLD, NEW = "qwen", "model"
ROOTS = ("apbv", "tests", "benchmarks", "scripts")
SKIP = {
    "tests/unit/test_plan_video_family.py",  # ``qwen`` is the Qwen2.5-VL rule's Sampling there
    "scripts/rename_model_variable.py",
}
IN_STRING = re.compile(r"(?:(?<=[{(`])|(?<=self\.))qwen(?=\.[a-z_])(?!\.tiktoken\b)")
"""``qwen.<attr>`` as code inside a string: after ``{``, ``(``, a backtick or ``self.``."""
MAX_LINE = 100


def tracked_files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *ROOTS], cwd=root, capture_output=True, text=True,
                         check=True).stdout.split()
    return [root / f for f in out if f.endswith(".py") and f not in SKIP]


def clashes(source: str, where: str) -> list[str]:
    """Scopes in which both names are used: renaming would merge two variables."""
    tree = ast.parse(source)
    found = []

    def names(node: ast.AST) -> set[str]:
        out = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                out.add(sub.id)
            elif isinstance(sub, ast.arg):
                out.add(sub.arg)
        return out

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if {OLD, NEW} <= names(node):
                found.append(f"{where}:{node.lineno}: a function uses both {OLD!r} and {NEW!r}")
        if isinstance(node, ast.ClassDef):
            attrs = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                     and isinstance(a.value, ast.Name) and a.value.id == "self"}
            if {OLD, NEW} <= attrs:
                found.append(f"{where}:{node.lineno}: class {node.name} has self.{OLD} and "
                             f"self.{NEW}")
    top = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            top |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            top |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    if {OLD, NEW} <= top:
        found.append(f"{where}: module-level {OLD!r} and {NEW!r}")
    return found


def rename(source: str) -> tuple[str, int]:
    """(the renamed source, how many places changed)."""
    lines = source.splitlines(keepends=True)
    edits: dict[int, list[tuple[int, int, str]]] = {}  # row -> (col, old length, new text)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok in tokens:
        (row, col), (end_row, _) = tok.start, tok.end
        if tok.type == tokenize.NAME and tok.string == OLD:
            edits.setdefault(row, []).append((col, len(OLD), NEW))
        elif tok.type == tokenize.STRING and end_row == row:  # one-line strings: column-exact
            for m in IN_STRING.finditer(tok.string):
                edits.setdefault(row, []).append((col + m.start(), len(OLD), NEW))
        elif tok.type == tokenize.STRING:  # a docstring over several lines
            text_lines = tok.string.split("\n")
            for k, text in enumerate(text_lines):
                base = col if k == 0 else 0
                for m in IN_STRING.finditer(text):
                    edits.setdefault(row + k, []).append((base + m.start(), len(OLD), NEW))
    if not edits:
        return source, 0
    growth = len(NEW) - len(OLD)

    def moved(row: int, col: int) -> int:
        """How far column ``col`` of ``row`` moves from the renames before it on the row."""
        return growth * sum(1 for c, _, _ in edits.get(row, ()) if c < col)

    # Lines continued under an opening bracket follow the bracket (hanging indents stay).
    shift: dict[int, int] = {}
    stack: list[tuple[int, int]] = []  # (old column just after the bracket, its move)
    done_row = 0  # the last row a token has reached
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    for tok in tokens:
        row, col = tok.start
        if row > done_row and stack and tok.type not in skip:  # a continued line's start
            after, by = stack[-1]
            if col == after and by:
                shift[row] = by
        if tok.type == tokenize.OP and tok.string in "([{":
            stack.append((col + 1, shift.get(row, 0) + moved(row, col)))
        elif tok.type == tokenize.OP and tok.string in ")]}" and stack:
            stack.pop()
        if tok.type not in skip:
            done_row = max(done_row, tok.end[0])
    count = 0
    for row, row_edits in edits.items():
        line = lines[row - 1]
        for col, length, text in sorted(row_edits, reverse=True):
            assert line[col:col + length] == OLD, (row, col, line)
            line = line[:col] + text + line[col + length:]
            count += 1
        lines[row - 1] = line
    for row, by in shift.items():
        lines[row - 1] = " " * by + lines[row - 1]
    return "".join(lines), count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list only, write nothing")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    files = tracked_files(root)
    problems = [c for f in files for c in clashes(f.read_text(), str(f.relative_to(root)))]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"refused: {len(problems)} scope(s) already use {NEW!r}", file=sys.stderr)
        return 2
    total, long_lines = 0, []
    for path in files:
        source = path.read_text()
        renamed, count = rename(source)
        if not count:
            continue
        total += count
        where = path.relative_to(root)
        print(f"{where}: {count}")
        before = source.splitlines()
        for n, line in enumerate(renamed.splitlines(), 1):
            if len(line) > MAX_LINE >= len(before[n - 1]):
                long_lines.append(f"{where}:{n}: {len(line)} characters")
        if not args.check:
            path.write_text(renamed)
    print(f"{total} place(s){' to rename' if args.check else ' renamed'}")
    if long_lines:
        print("longer than 100 characters now (wrap by hand):\n" + "\n".join(long_lines))
    return 1 if args.check and total else 0


if __name__ == "__main__":
    sys.exit(main())
