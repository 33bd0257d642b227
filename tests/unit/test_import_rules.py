"""Import facts of the package, read from the source with ``ast`` (nothing of apbv or torch is
imported): imports flow one way, the config is a leaf without torch, files stay small and the
package root holds the pipeline's shared modules only.

What counts as an import of module M by module N:
- ``import a.b`` and ``from a.b import c`` are edges to ``a.b``, and to ``a.b.c`` when that is a
  module; importing a package's submodule also runs the package's ``__init__``, which is not
  counted when that package contains N (it is already being imported when N runs);
- *module level*: statements executed when N is imported (also inside top-level ``if``/``try``),
  except ``if TYPE_CHECKING:`` blocks; *lazy*: inside a function or method body, executed only
  when it is called. Cycles are looked for among module-level imports only (a lazy import runs
  after every module involved has finished importing, so it cannot see a half-made module).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "apbv"

MAX_LINES = 400
"""No file in apbv/ is longer than this."""

MAX_ROOT_MODULES = 12
"""Modules at the package root besides ``__init__.py`` and ``__main__.py``: the pipeline's
shared floor (config, validate, modes, plan, ownership, layout, positions, sequence, context,
comm, distributed, timing); everything else lives in a package named for what it does."""

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The dotted modules one import statement names (submodules resolved where they exist)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolve against this module's package
        package = module if _sources()[module].name == "__init__.py" else \
            module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    names = [base]
    for alias in node.names:
        if f"{base}.{alias.name}" in _sources():
            names.append(f"{base}.{alias.name}")
    return names


@cache
def _imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(module-level imports, lazy imports) of ``module``: dotted names, third-party ones too."""
    tree = ast.parse(_sources()[module].read_text(), filename=str(_sources()[module]))
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_stmt(sub, in_function)
                continue
            visit_stmt(child, in_function)

    def visit_stmt(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (lazy if in_function else eager).update(_imported_names(node, module))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
        visit(node, inner)

    visit(tree, False)
    return frozenset(eager), frozenset(lazy)


def _type_checking_imports(module: str) -> set[str]:
    """The dotted modules ``module`` imports inside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(_sources()[module].read_text(), filename=str(_sources()[module]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        out.update(_imported_names(inner, module))
    return out


def _apbv_edges(module: str, *, lazy: bool = False) -> set[str]:
    """The apbv modules ``module`` imports (module level; with ``lazy`` also the lazy ones),
    without the packages that contain ``module``."""
    eager, later = _imports(module)
    names = eager | later if lazy else eager
    own = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}
    if _sources()[module].name == "__init__.py":
        own.add(module)
    return {n for n in names if n in _sources() and n not in own and n != module}


def _closure(module: str) -> set[str]:
    """Every module (apbv or not) that importing ``module`` imports, through apbv modules'
    module-level imports."""
    seen, todo, found = {module}, [module], set()
    while todo:
        current = todo.pop()
        found |= _imports(current)[0]
        for name in _apbv_edges(current):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return found | seen


def _cycles(*, lazy: bool = False) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) in the module-level import graph (with ``lazy``: lazy imports too; Tarjan)."""
    graph = {m: sorted(_apbv_edges(m, lazy=lazy)) for m in _sources()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return out


def test_the_rules_see_what_they_check() -> None:
    """The reader finds module-level, TYPE_CHECKING and lazy imports where they are."""
    eager, lazy = _imports("apbv.config")
    assert {"apbv.modes", "apbv.config.video"} <= eager
    eager, lazy = _imports("apbv.engine.request")  # RuntimeConfig under TYPE_CHECKING only
    assert "apbv.config" not in eager | lazy and "apbv.validate" in eager
    assert "apbv.engine.engine" in _imports("apbv.cli.generate")[1]
    assert "torch" in _closure("apbv.ownership")
    assert len(_sources()) > 100


def test_no_import_cycles() -> None:
    assert _cycles() == [], "module-level import cycles among apbv modules"


LAZY_CYCLES = [
    {"apbv.engine.decode", "apbv.engine.decode_graph"},
]
"""Circles closed only by a lazy import: the decode loop and its CUDA-graph step."""


def test_lazy_import_cycles_are_only_the_known_ones() -> None:
    new = [c for c in _cycles(lazy=True) if not any(set(c) <= known for known in LAZY_CYCLES)]
    assert new == [], "import cycles through lazy imports"


def test_cost_imports_nothing_from_engine_or_model() -> None:
    bad = {}
    for module in _sources():
        if module == "apbv.cost" or module.startswith("apbv.cost."):
            direct = {n for n in _apbv_edges(module, lazy=True)
                      if n.startswith(("apbv.engine", "apbv.model"))}
            reached = {n for n in _closure(module) if n.startswith(("apbv.engine", "apbv.model"))}
            if direct or reached:
                bad[module] = sorted(direct | reached)
    assert bad == {}, "cost/ must import only the pure floor (plan, ownership, ...)"


def test_config_imports_no_torch() -> None:
    heavy = sorted(n for n in _closure("apbv.config")
                   if n.split(".")[0] in ("torch", "transformers", "numpy"))
    assert heavy == [], f"apbv.config imports {heavy} (directly or through apbv modules)"
    assert {n for n in _closure("apbv.config") if n.startswith("apbv.")} <= \
        {"apbv.config", "apbv.config.video", "apbv.modes", "apbv.plan", "apbv.validate"}


def test_config_imports_nothing_from_video() -> None:
    """The video schema lives in the config (apbv.config.video) and the video stage imports it,
    so no module of the config imports apbv.video, lazily or for types either."""
    bad = {}
    for module in _sources():
        if module == "apbv.config" or module.startswith("apbv.config."):
            eager, lazy = _imports(module)
            typed = _type_checking_imports(module)
            video = sorted(n for n in eager | lazy | typed if n.split(".")[:2] == ["apbv", "video"])
            if video:
                bad[module] = video
    assert bad == {}, "the config imports the video stage"


def _long_files() -> dict[str, int]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out[path.relative_to(PACKAGE.parent).as_posix()] = lines
    return out


def test_no_file_over_400_lines() -> None:
    assert _long_files() == {}, f"files over {MAX_LINES} lines"


def test_at_most_12_modules_at_the_package_root() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py")
                  if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def _stream_mode_strings() -> list[str]:
    """``"stream"`` string constants (not docstrings, not f-string parts) in apbv/engine."""
    out = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "stream":
                out.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.lineno}")
    return out


def test_no_stream_mode_string_in_engine() -> None:
    assert _stream_mode_strings() == [], "a stream ask reports a mode of the mode table"
