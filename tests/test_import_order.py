"""The package's layers: each file imports only from its own layer or the layers below it, at the
top of the file, and no files import each other in a circle.

The order, lowest first, is `LAYERS` below (docs/INTERNALS.md "Layers" shows the same table).
The test reads every .py file of the installed package (dist_quant/, and kernels/, coordinator/,
launch/ as dist_quant.kernels, .coordinator, .launch) with `ast`, without importing any of them,
and fails on:
- a file that `LAYERS` does not place;
- a top-level import of a module in a higher layer;
- an import of a dist_quant module inside a function, unless `LAZY_IMPORTS` lists it with the
  third-party package it keeps out of a process that does not need it (checked: the importer must
  not import that package at its top level, the imported module must);
- a cycle of imports (top-level and in-function ones alike: an import moved into a function to
  dodge a cycle is the cycle still there);
- an entry of `KNOWN_VIOLATIONS` that no longer happens (the list only shrinks).
Imports under `if TYPE_CHECKING:` (type-only) and under `if __name__ == "__main__":` (run as a
script only) are not imports of the package. Third-party imports (ray, triton, yaml, ...) are not
checked. The PEP 562 tables `_EXPORTS` of dist_quant/__init__.py and coordinator/__init__.py
(names imported on first use, through importlib) count as imports of their package's layer.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("dist_quant", "dist_quant.kernels", "dist_quant.coordinator", "dist_quant.launch")

# Lowest first. A file may import from its own layer and the ones above it in this table.
# `pkg.*` patterns place every module of a package (at any depth).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernels", ("dist_quant.kernels", "dist_quant.kernels.*")),
    (
        "values",
        (
            "dist_quant.formats",
            "dist_quant.checks",
            "dist_quant.roles",
            "dist_quant.factory_keys",
            "dist_quant.jsonl",
            "dist_quant.kinds",
            "dist_quant.recipe_files",
        ),
    ),
    ("recipes", ("dist_quant.recipes",)),
    (
        "tensor/quantizers/gemm",
        (
            "dist_quant.tensor",
            "dist_quant.quantizers",
            "dist_quant.nvfp4_tensor",
            "dist_quant.nvfp4",
            "dist_quant.gemm",
        ),
    ),
    ("factories", ("dist_quant.factories", "dist_quant.policy")),
    ("state", ("dist_quant.state",)),
    ("amax/parallel", ("dist_quant.amax", "dist_quant.parallel", "dist_quant.fsdp_tensor")),
    ("binding", ("dist_quant.binding",)),
    ("context", ("dist_quant.context",)),
    ("runtime", ("dist_quant.runtime", "dist_quant.recompute")),
    # what a forward runs (eager, traced, recomputed) and its amax enrolment: below the modules
    ("forward", ("dist_quant.forward",)),
    # a module's extra-state format: the modules' get/set_extra_state call it
    ("module state", ("dist_quant.checkpoint.module_state",)),
    (
        "modules",
        (
            "dist_quant.modules",
            "dist_quant.modules.*",
            "dist_quant.graphs",
            "dist_quant.telemetry",
            "dist_quant.fsdp",
        ),
    ),
    (
        "checkpoint",
        (
            "dist_quant.checkpoint",
            "dist_quant.checkpoint.*",
            "dist_quant.checkpoint_dcp",
            "dist_quant.checkpoint_job",
        ),
    ),
    ("convert", ("dist_quant.convert",)),
    ("exports", ("dist_quant",)),  # dist_quant/__init__.py: the public names, imported lazily
    # the switch protocol's pure files (messages, phases, rules, results): under the coordinator
    # that drives them, and free of its threads, transports and logs
    (
        "switch protocol",
        (
            "dist_quant.coordinator.schema",
            "dist_quant.coordinator.tally",
            "dist_quant.coordinator.timing",
            "dist_quant.coordinator.phases",
            "dist_quant.coordinator.protocol",
            "dist_quant.coordinator.results",
            "dist_quant.coordinator.decide",
            "dist_quant.coordinator.decide_cancel",
        ),
    ),
    ("coordinator", ("dist_quant.coordinator", "dist_quant.coordinator.*")),
    ("integrations", ("dist_quant.integrations", "dist_quant.integrations.*")),
    ("launch", ("dist_quant.launch", "dist_quant.launch.*")),
)

# In-function imports that keep a heavy package out of a process that does not need it:
# (importer, imported) -> the package deferred (checked: the importer does not import it at its
# top level, the imported module does).
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    # `dist-quant --help`, `switch`, `cancel`, `status` and `stats` never import torch
    # (tests/launch/test_cli.py runs them and checks): the subcommands that need it import it
    # when they run.
    ("dist_quant.launch.cli", "dist_quant.launch.demo"): "torch",
    ("dist_quant.launch.cli", "dist_quant.launch.roles"): "torch",
    # The demo's launcher process parses the model spec and drives switches; only its ranks
    # train, so only they load the kernels (Triton, the custom ops: seconds of start-up).
    ("dist_quant.launch.demo", "dist_quant.launch.ray_train"): "triton",
    ("dist_quant.launch.demo_runners", "dist_quant.launch.demo_train"): "triton",
    ("dist_quant.launch.demo_model", "dist_quant.modules"): "triton",
    ("dist_quant.launch.demo_guard", "dist_quant.runtime"): "triton",
}

# Known violations awaiting a fix (none): an entry that no longer happens fails the test.
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool
    on_first_use: bool = False  # a PEP 562 export, imported when the name is first looked up


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in ROOTS:
        spec = importlib.util.find_spec(root)
        assert spec is not None and spec.submodule_search_locations, root
        folder = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((root, *parts))] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _is_main_guard(test: ast.expr) -> bool:
    return ast.unparse(test).replace('"', "'") == "__name__ == '__main__'"


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.package = (
            module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        )
        self.depth = 0
        self.found: list[Import] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) or _is_main_guard(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        if name == "dist_quant" or name.startswith("dist_quant."):
            self.found.append(Import(self.module, name, line, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.package
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in MODULES else base, node.lineno)


def _lazy_exports(module: str, tree: ast.Module) -> list[Import]:
    """The PEP 562 `_EXPORTS = {name: "module"}` table of a package, as imports."""
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
            if isinstance(node.value, ast.Dict):
                for value in node.value.values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        found.append(Import(module, value.value, value.lineno, False, True))
    return found


def _imports() -> list[Import]:
    found: list[Import] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        collector = _ImportCollector(module)
        collector.visit(tree)
        found += collector.found + _lazy_exports(module, tree)
    return found


IMPORTS = _imports()


def _layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return index
    return None


def _top_level_third_party(module: str) -> set[str]:
    """Every package outside dist_quant that importing `module` imports (its parent packages'
    top levels included), read from the sources."""
    seen: set[str] = set()
    stack = [module]
    packages: set[str] = set()
    while stack:
        parts = stack.pop().split(".")
        for name in (".".join(parts[: i + 1]) for i in range(len(parts))):
            if name in seen or name not in MODULES:
                continue
            seen.add(name)
            packages |= _THIRD_PARTY_AT_TOP[name]
            stack += sorted(_TOP_LEVEL_IMPORTS[name])
    return packages


def _third_party_at_top(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and not (
                _is_type_checking(node.test) or _is_main_guard(node.test)
            ):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.If):
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)
                walk(node.orelse)
                walk(node.finalbody)

    walk(tree.body)
    names.discard("dist_quant")
    return names


_THIRD_PARTY_AT_TOP = {m: _third_party_at_top(ast.parse(p.read_text())) for m, p in MODULES.items()}
_TOP_LEVEL_IMPORTS = {
    m: {i.imported for i in IMPORTS if i.importer == m and not (i.in_function or i.on_first_use)}
    for m in MODULES
}


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _violations() -> dict[str, str]:
    """violation -> where (file:line) it happens."""
    found: dict[str, str] = {}
    edges: set[tuple[str, str]] = set()
    for imp in IMPORTS:
        where = f"{MODULES[imp.importer]}:{imp.line}"
        if imp.imported not in MODULES:
            found.setdefault(f"missing: {imp.importer} -> {imp.imported}", where)
            continue
        edges.add((imp.importer, imp.imported))
        if imp.in_function:
            if (imp.importer, imp.imported) not in LAZY_IMPORTS:
                found.setdefault(f"in function: {imp.importer} -> {imp.imported}", where)
            continue
        low, high = _layer_of(imp.importer), _layer_of(imp.imported)
        if low is not None and high is not None and high > low:
            found.setdefault(
                f"upward: {imp.importer} ({LAYERS[low][0]}) -> {imp.imported} ({LAYERS[high][0]})",
                where,
            )
    for component in _cycles(edges):
        path = _shortest_cycle(component, edges)
        found[f"cycle: {', '.join(component)}"] = (
            "one of its loops: "
            + " -> ".join(f"{a} (line {_line_of(a, b)})" for a, b in zip(path, path[1:]))
            + f" -> {path[-1]}"
        )
    return found


def _shortest_cycle(component: list[str], edges: set[tuple[str, str]]) -> list[str]:
    """The shortest loop through the component's first module, first module repeated at the end
    (breadth-first inside the component)."""
    inside = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        step = []
        for a in frontier:
            for b in sorted(b for x, b in edges if x == a and b in inside):
                if b == start:
                    path = [a]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if b not in came_from:
                    came_from[b] = a
                    step.append(b)
        frontier = step
    raise AssertionError(f"no loop through {start} in {component}")


def _line_of(importer: str, imported: str) -> int:
    return min(i.line for i in IMPORTS if i.importer == importer and i.imported == imported)


def test_every_file_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if _layer_of(m) is None)
    assert not unplaced, (
        f"{unplaced}: not in LAYERS of tests/test_import_order.py; place each file in the layer "
        "of what it imports and what imports it (and update docs/INTERNALS.md's table)"
    )


def test_no_upward_in_function_or_circular_import_beyond_the_known_ones() -> None:
    new = {v: where for v, where in _violations().items() if v not in KNOWN_VIOLATIONS}
    assert not new, "import order broken (see docs/INTERNALS.md, Layers):\n" + "\n".join(
        f"  {v}  [{where}]" for v, where in sorted(new.items())
    )


def test_known_violations_still_happen() -> None:
    gone = sorted(KNOWN_VIOLATIONS - set(_violations()))
    assert not gone, (
        "fixed, so remove from KNOWN_VIOLATIONS in tests/test_import_order.py:\n  "
        + "\n  ".join(gone)
    )


def test_each_allowed_lazy_import_keeps_its_package_out() -> None:
    stale = []
    for (importer, imported), package in sorted(LAZY_IMPORTS.items()):
        if not any(
            i.importer == importer and i.imported == imported and i.in_function for i in IMPORTS
        ):
            stale.append(f"{importer} -> {imported}: no such in-function import any more")
        elif package in _top_level_third_party(importer):
            stale.append(f"{importer} imports {package} at its top level already")
        elif package not in _top_level_third_party(imported):
            stale.append(f"{imported} does not import {package} at its top level")
    assert not stale, "LAZY_IMPORTS entries to move to the top of their file:\n  " + "\n  ".join(
        stale
    )


def test_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    # the checker itself: a->b->c->a is one cycle, d->a hangs off it, e imports itself
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("d", "a"), ("e", "e")}
    assert _cycles(edges) == [["a", "b", "c"], ["e"]]
    assert _shortest_cycle(["a", "b", "c"], edges | {("a", "c")}) == ["a", "c", "a"]
    assert _shortest_cycle(["e"], edges) == ["e", "e"]
