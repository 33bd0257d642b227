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


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node of ``graph`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def _cycles(*, lazy: bool = False) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) in the module-level import graph (with ``lazy``: lazy imports too)."""
    graph = {m: _apbv_edges(m, lazy=lazy) for m in _sources()}
    return [sorted(c) for c in _components(graph)] + [[v] for v in graph if v in graph[v]]


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


# --- The rooms (issue 34): every import counts here, TYPE_CHECKING and lazy ones included ------

SERVE_ROOMS = ("ranks", "scheduler", "front", "streams", "watches")
"""serve/'s subpackages from the bottom up; its root modules (the app) sit above them all."""
NO_SERVER = ("fastapi", "starlette", "uvicorn", "ray", "apbv.serve")
"""What the protocol (apbv.openai) and the standing question (apbv.watch) never import."""


@cache
def _every_import(module: str) -> frozenset[str]:
    """Every dotted name ``module`` imports anywhere: module level, TYPE_CHECKING, lazy."""
    tree = ast.parse(_sources()[module].read_text(), filename=str(_sources()[module]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(_imported_names(node, module))
    return frozenset(out)


def _every_edge(module: str) -> set[str]:
    """The apbv modules ``module`` imports anywhere, without the packages that contain it."""
    own = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}
    if _sources()[module].name == "__init__.py":
        own.add(module)
    return {n for n in _every_import(module) if n in _sources() and n not in own and n != module}


def _file_circles(prefix: str = "apbv") -> list[set[str]]:
    """Import circles among the modules under ``prefix``, every import counted."""
    inside = [m for m in _sources() if m == prefix or m.startswith(prefix + ".")]
    return _components({m: {n for n in _every_edge(m) if n in inside} for m in inside})


def _room(module: str) -> str:
    """The house's room of a module: its package under apbv, or itself at the root."""
    return ".".join(module.split(".")[:2])


def _room_circles() -> list[set[str]]:
    """Circles between the house's rooms: each holds at least one arrow back up."""
    graph: dict[str, set[str]] = {}
    for module in _sources():
        graph.setdefault(_room(module), set()).update(
            _room(n) for n in _every_edge(module) if _room(n) != _room(module))
    return _components(graph)


def _serve_floor(module: str) -> int:
    """A serve/ module's floor: its room's place in :data:`SERVE_ROOMS`, the root above."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in SERVE_ROOMS:
        return SERVE_ROOMS.index(parts[2])
    return len(SERVE_ROOMS)


def test_the_room_rules_see_what_they_check() -> None:
    """TYPE_CHECKING imports count here, and the floors are the ones named."""
    assert "apbv.openai.chat" in _every_edge("apbv.serve.scheduler.admission")  # TYPE_CHECKING
    assert "apbv.sequence" in _every_edge("apbv.cost.work")  # lazy
    assert _serve_floor("apbv.serve.ranks.ops") < _serve_floor("apbv.serve.scheduler.replicas") \
        < _serve_floor("apbv.serve.front.front") < _serve_floor("apbv.serve.streams.registry") \
        < _serve_floor("apbv.serve.watches.routes") < _serve_floor("apbv.serve.app")
    assert "apbv.video" not in {_room(n) for n in _every_edge("apbv.config")}


def test_openai_and_watch_import_no_server() -> None:
    """The protocol and the standing question are spoken by clients too (apbv batch, apbv
    watch): no FastAPI, no Ray and no apbv.serve, directly or through what they import."""
    bad = {}
    for module in _sources():
        if module.startswith(("apbv.openai", "apbv.watch")):
            names = _every_import(module) | _closure(module)
            found = sorted(n for n in names if n.startswith(NO_SERVER))
            if found:
                bad[module] = found
    assert bad == {}, "apbv.openai and apbv.watch import the server or its frameworks"


def test_cli_imports_the_server_only_from_cli_serve() -> None:
    bad = {m: sorted(n for n in _every_import(m) if n.startswith("apbv.serve"))
           for m in _sources() if m.startswith("apbv.cli") and m != "apbv.cli.serve"}
    assert {m: v for m, v in bad.items() if v} == {}, \
        "only apbv/cli/serve.py imports apbv.serve (the protocol is apbv.openai)"


def test_serve_imports_run_down_its_rooms() -> None:
    """ranks <- scheduler <- front <- streams <- watches <- the app (serve/'s root modules)."""
    up = sorted(f"{m} -> {n}" for m in _sources() if m.startswith("apbv.serve.")
                for n in _every_edge(m)
                if n.startswith("apbv.serve.") and _serve_floor(n) > _serve_floor(m))
    assert up == [], "imports that run up serve/'s rooms"


def test_no_import_circle_inside_serve() -> None:
    assert _file_circles("apbv.serve") == [], "import circles inside serve/"


HOUSE_CIRCLES_TODAY = [{"apbv.engine.answer", "apbv.engine.decode", "apbv.engine.decode_graph"}]
"""The package's one circle, every import counted: the decode loop and its CUDA-graph step
(lazy both ways), with the answer's records (whose ``DecodeSettings.graphs`` names the kept
steps' type under TYPE_CHECKING)."""


def test_the_house_has_no_new_circle() -> None:
    new = [c for c in _file_circles() if not any(c <= known for known in HOUSE_CIRCLES_TODAY)]
    assert new == [], "new import circles (every import counted)"
    assert _room_circles() == [], _room_circles()


def test_the_house_has_no_back_arrow_and_at_most_one_circle() -> None:
    assert _room_circles() == [], "rooms importing each other: an arrow runs back up"
    assert len(_file_circles()) <= 1, _file_circles()
