"""The package's shape: layers in one order, no import circle, no module over 500 lines.

Import circles hide layering mistakes (a lower layer reaching up) and make
import order matter; every import counts, at module level or inside a
function, except those under ``if TYPE_CHECKING:`` (annotations only). The
root package's lazy public names (``crosscut.compile`` ...) count as imports
of the modules they load, so no lazy loader hides an edge.

The layers, lowest first (a module imports only from its own layer or below):

==============  ==============================================================
base            errors, version, fileio, precision, split_backward: helpers
                every layer reads
ir              ir/: graph, problem, plan (+ schema), schedule
frontend        frontend/: fx trace, shapes and FLOPs, aliasing, grad mode
cost_models     cost_models/: devices, clusters, costs, memory, links
partitioner     partitioner/ and the strategy search above one solve:
                options (the planning request), traced, strategy
codegen         codegen/: stage modules from a plan (code only, runs nothing)
runtime         runtime/: a shared core, local/ and dist/ wings
api             planning, distributed, api, verify, viz/, the root package
cli             cli/: commands, argument types, launch, model references
==============  ==============================================================
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "crosscut"
MAX_LINES = 500


_PARTITIONER = (
    "crosscut.partitioner",
    "crosscut.options",
    "crosscut.traced",
    "crosscut.strategy",
    "crosscut.layouts",
    "crosscut.state_limits",
)
_API = ("crosscut.planning", "crosscut.distributed", "crosscut.api", "crosscut.verify")
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "crosscut.errors",
            "crosscut.version",
            "crosscut.fileio",
            "crosscut.precision",
            "crosscut.split_backward",
            "crosscut.cpu_malloc",
        ),
    ),
    ("ir", ("crosscut.ir",)),
    ("frontend", ("crosscut.frontend",)),
    ("cost_models", ("crosscut.cost_models",)),
    ("partitioner", _PARTITIONER),
    ("codegen", ("crosscut.codegen",)),
    ("runtime", ("crosscut.runtime",)),
    ("api", (*_API, "crosscut.viz", "crosscut")),
    ("cli", ("crosscut.cli",)),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a module counts
    as the module, or as the submodule when it is one)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    for a in node.names
                ]
            for t in targets:
                if t.startswith("crosscut") and (o := owner(t)) and o != mod:
                    edges.add(o)
        graph[mod] = edges
    graph["crosscut"] |= {owner(m) or m for m in _root_lazy_names()}
    return graph


def _root_lazy_names() -> set[str]:
    """The modules behind the root package's lazy public names (its ``_LAZY`` table)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            table = ast.literal_eval(node.value)
            return set(table.values())
    return set()


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the layer a module belongs to (longest prefix wins)."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best_len:
                best, best_len = i, len(pre)
    return best


def unit_of(module: str) -> str:
    """The package-level unit: ``crosscut.X`` (a subpackage with everything under it)."""
    return ".".join(module.split(".")[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and graph["crosscut.api"]  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do): {long}"


def test_every_module_has_a_layer() -> None:
    homeless = sorted(m for m in import_graph() if layer_of(m) < 0)
    assert not homeless, f"modules in no layer (add them to LAYERS): {homeless}"


def test_every_import_goes_to_the_same_layer_or_below() -> None:
    graph = import_graph()
    up = sorted(
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {n} ({LAYERS[layer_of(n)][0]})"
        for m, edges in graph.items()
        for n in edges
        if layer_of(n) > layer_of(m)
    )
    assert not up, "imports that reach up a layer:\n" + "\n".join(up)


def test_the_packages_have_no_import_circle() -> None:
    graph = import_graph()
    units: dict[str, set[str]] = {}
    for m, edges in graph.items():
        units.setdefault(unit_of(m), set()).update(unit_of(n) for n in edges)
    for u, edges in units.items():
        edges.discard(u)
    cycle = find_cycle(units)
    assert cycle is None, "package circle: " + " -> ".join(cycle or [])


def test_the_runtime_wings_stand_on_the_core_only() -> None:
    """``runtime/local`` and ``runtime/dist`` never import each other; the core neither."""
    wings = ("crosscut.runtime.local", "crosscut.runtime.dist")
    bad = []
    for m, edges in import_graph().items():
        if not m.startswith("crosscut.runtime.") or m in wings:
            continue
        mine = next((w for w in wings if m.startswith(w + ".")), None)
        bad += [f"{m} -> {n}" for n in edges if any(n.startswith(w) and w != mine for w in wings)]
    assert not bad, bad


def test_no_lazy_loader_or_module_class_hack() -> None:
    """Only the root package resolves names lazily (counted above); no module swaps its class."""
    found = []
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            lazy = isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            if lazy and node in tree.body and mod != "crosscut":
                found.append(f"{mod}: module-level __getattr__")
            if isinstance(node, ast.ClassDef) and any(
                "ModuleType" in ast.unparse(b) for b in node.bases
            ):
                found.append(f"{mod}: class {node.name} subclasses ModuleType")
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute)
                and t.attr == "__class__"
                and "sys.modules" in ast.unparse(t.value)
                for t in node.targets
            ):
                found.append(f"{mod}: assigns a module's __class__")
    assert not found, found


def test_no_two_modules_share_a_file_name() -> None:
    seen: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.name, []).append(str(p.relative_to(PACKAGE.parent)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"modules sharing a name (rename one to say what it is): {twins}"


def test_the_layer_checks_see_a_violation() -> None:
    assert layer_of("crosscut.ir.plan") < layer_of("crosscut.partitioner.solvers.cpsat")
    assert layer_of("crosscut.codegen.split") < layer_of("crosscut.runtime.engine")
    assert layer_of("crosscut.api") < layer_of("crosscut.cli.commands")
    assert layer_of("crosscut.strategy") == layer_of("crosscut.partitioner")
    assert unit_of("crosscut.runtime.dist.p2p") == "crosscut.runtime"


def _torch_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found.append(str(node.module))
    return found


def test_the_ir_is_plain_data_without_torch() -> None:
    """The solvers, the simulator and the drawings read the IR without loading torch."""
    found = {p.name: names for p in (PACKAGE / "ir").glob("*.py") if (names := _torch_imports(p))}
    assert not found, f"ir/ modules importing torch (annotations go under TYPE_CHECKING): {found}"


def test_the_architecture_map_lists_every_module_with_its_imports() -> None:
    """docs/ARCHITECTURE.md has one row per module, and its imports column is the walk's."""
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    rows: dict[str, set[str]] = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 4 and cells[1].startswith("`") and cells[1].endswith(".py`"):
            listed = {x.strip() for x in cells[3].split(",")} - {"—", ""}
            rows[cells[1].strip("`")] = listed
    graph = import_graph()
    wrong = []
    for mod, path in sorted(_modules().items()):
        rel = str(path.relative_to(PACKAGE))
        want = {n.removeprefix("crosscut.") for n in graph[mod]}
        if rows.get(rel) != want:
            wrong.append(f"{rel}: map says {sorted(rows.get(rel, []))}, imports {sorted(want)}")
    stale = sorted(set(rows) - {str(p.relative_to(PACKAGE)) for p in _modules().values()})
    assert not wrong and not stale, "fix docs/ARCHITECTURE.md:\n" + "\n".join(wrong + stale)


# ---- functions a reader can hold in their head (issue 26) ------------------------------

MAX_FUNCTION_LINES = 80
MAX_PUBLIC_PARAMETERS = 8
LONG_BECAUSE = "over 80 lines because"  # what a long function's docstring must say


def _functions() -> list[tuple[str, ast.ClassDef | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method in the package, with its class (None at module level)."""
    found: list[tuple[str, ast.ClassDef | None, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        owner: dict[int, ast.ClassDef] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                owner.update({id(sub): node for sub in node.body})
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{rel}:{node.lineno} {node.name}", owner.get(id(node)), node))
    return found


def test_every_function_fits_on_a_screen_or_says_why() -> None:
    """A function over 80 lines (docstring included) is split, or its docstring says
    why it is not (the words "over 80 lines because")."""
    long = [
        f"{where} ({fn.end_lineno - fn.lineno + 1} lines)"  # type: ignore[operator]
        for where, _, fn in _functions()
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
        and LONG_BECAUSE not in (ast.get_docstring(fn) or "")
    ]
    assert not long, f"split these (or say why not, {LONG_BECAUSE!r}): {long}"


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    named = a.posonlyargs + a.args + a.kwonlyargs
    return [x.arg for x in named if x.arg not in ("self", "cls")]


def test_public_functions_take_an_options_object_not_a_dozen_keywords() -> None:
    """A public function (or a public class's constructor) takes at most 8 named
    parameters; more options go in one options object (crosscut/options.py), given
    whole or as ``**keywords`` its TypedDict types."""
    wide = []
    for where, cls, fn in _functions():
        public = not fn.name.startswith("_") or fn.name == "__init__"
        if cls is not None and cls.name.startswith("_"):
            public = False
        if public and len(_parameters(fn)) > MAX_PUBLIC_PARAMETERS:
            wide.append(f"{where} ({len(_parameters(fn))} parameters)")
    assert not wide, f"group these parameters into an options object: {wide}"


def test_the_shape_checks_see_a_long_or_wide_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    tree = ast.parse(f"def f(a, b, c, d, e, f, g, h, i):\n    '''doc'''\n{body}\n")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    assert len(_parameters(fn)) > MAX_PUBLIC_PARAMETERS
