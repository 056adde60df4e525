"""The package's modules import each other without cycles (function-level imports included)."""

import ast
from pathlib import Path

import dbsn

PACKAGE = Path(dbsn.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the dbsn modules it imports anywhere in its body (a package import counts as
    importing the package's __init__; `from pkg import name` as importing pkg.name when that
    is a module)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "dbsn.runtime.build" in graph and "dbsn.runtime.ddp" in graph["dbsn.runtime.build"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


#: The floors of the house, bottom first: a module imports only from its own package and from
#: packages on lower floors (packages on one floor may use each other, without cycles).
FLOORS = (
    ("precision", "conf", "extensions"),  # float32 islands; the configs and their extensions
    (
        "structure",
        "nets",
        "bayes",
        "natgrad",
        "sampling",
        "metrics",
        "data",
    ),  # distributions, networks, optimisers, measures, data
    ("methods",),  # a network joined with a distribution
    ("posthoc",),  # fitted on a finished method
    ("evaluation",),  # evaluations, their pipeline, the report
    ("runtime",),  # entry points, launching, checkpoints, config checks
    ("tools",),  # command-line tools built on the runtime
    ("api", "testing"),  # the public surface and its checks
)


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def floor_of(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the modules it imports from a higher floor."""
    found = {}
    for module, targets in graph.items():
        if not _layer(module):
            continue
        up = sorted(t for t in targets if _layer(t) and floor_of(_layer(t)) > floor_of(_layer(module)))
        if up:
            found[module] = up
    return found


def test_the_folder_list_is_the_architecture():
    """Two loose modules at the top (the float32 islands and the extensions' config folders, which
    every layer may use); the rest are packages, each on one floor."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert loose == ["extensions", "precision"]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(name for floor in FLOORS for name in floor if name not in loose)


def test_no_import_runs_up_a_floor():
    assert upward_imports(import_graph()) == {}


def test_the_floor_check_sees_an_upward_import():
    graph = {
        "dbsn.methods.base": {"dbsn.posthoc.laplace", "dbsn.nets.cell"},
        "dbsn.runtime.run": {"dbsn.tools.report"},
        "dbsn.evaluation.ood": {"dbsn.methods.base"},
    }
    assert upward_imports(graph) == {
        "dbsn.methods.base": ["dbsn.posthoc.laplace"],
        "dbsn.runtime.run": ["dbsn.tools.report"],
    }


def test_what_goes_to_wandb_sits_below_the_evaluation_suite():
    """`dbsn.evaluation.tracking` (metric names and definitions) is imported by evaluation and
    runtime: it imports nothing of the package."""
    graph = import_graph()
    assert "dbsn.evaluation.tracking" in graph["dbsn.evaluation.results"]
    assert {t for t in graph["dbsn.evaluation.tracking"] if t.startswith("dbsn")} == set()
