"""The module graph of ``ssm_pack`` and ``mixers`` is one-way.

Every import a module makes is an edge, wherever it sits (module level or inside a function;
only ``if TYPE_CHECKING:`` blocks are left out, they never run). ``from pkg import sub`` where
``sub`` is a module is an edge to ``pkg.sub``; ``from pkg import name`` is an edge to ``pkg``.
The graph must have no cycle, ``ssm_pack`` (metadata) must import nothing from ``mixers``,
``benchmarks`` or ``tests``, and inside ``mixers`` every import points down its rooms (ops,
inference, layers, model, then checkpoints and the report, integrations and the demo, the command:
:data:`MIXER_FLOORS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ssm_pack", "mixers")
UPWARD = ("mixers", "benchmarks", "tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _base(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _targets(name: str, path: Path, known) -> set[str]:
    """Every module ``name`` imports (any top-level package, in or out of ``known``)."""
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = _base(name, path, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _targets(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` restricted to its own nodes, else ``None`` (iterative DFS)."""
    state: dict[str, int] = {}                     # 1 = on the path, 2 = done
    for root in sorted(graph):
        if root in state:
            continue
        path, iters = [root], [iter(sorted(graph[root] & graph.keys()))]
        state[root] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt] & graph.keys())))
    return None


def test_the_graph_sees_function_level_imports():
    graph = _graph()
    assert "ssm_pack.checks" in graph["ssm_pack.formats.params"]
    assert "torch.distributed" in graph["ssm_pack.parallel.layout_check"]      # imported inside a function
    assert "ssm_pack" in graph["mixers.model.hybrid"]


@pytest.mark.parametrize("graph,cycle", [
    pytest.param({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"], id="three"),
    pytest.param({"a": {"a"}}, ["a", "a"], id="self"),
    pytest.param({"a": {"b", "torch"}, "b": {"c"}, "c": set()}, None, id="none"),
])
def test_the_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle


def test_no_import_cycle_in_ssm_pack_or_mixers():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, target)`` pairs where an ``ssm_pack`` module imports from a layer above it."""
    return sorted((name, target) for name, targets in graph.items() if name.split(".")[0] == "ssm_pack"
                  for target in targets if target.split(".")[0] in UPWARD)


@pytest.mark.parametrize("graph,arrows", [
    pytest.param({"ssm_pack.a": {"mixers.ops"}, "mixers.b": {"ssm_pack"}}, [("ssm_pack.a", "mixers.ops")], id="up"),
    pytest.param({"ssm_pack.a": {"tests.oracles", "torch"}}, [("ssm_pack.a", "tests.oracles")], id="tests"),
    pytest.param({"ssm_pack.a": {"ssm_pack.b", "torch"}, "mixers.b": {"ssm_pack.a"}}, [], id="down"),
])
def test_the_upward_finder(graph, arrows):
    assert _upward(graph) == arrows


def test_ssm_pack_imports_nothing_above_it():
    upward = _upward(_graph())
    assert upward == [], f"ssm_pack imports from a layer above it: {upward}"


# The rooms of mixers, lowest first: a module may import from its own room or a lower floor only.
# ``mixers`` (the package's __init__), ``mixers.__main__`` and the ``mixers.carry`` re-export sit on top.
MIXER_FLOORS = {
    "mixers.ops": 1, "mixers.inference": 2, "mixers.layers": 3, "mixers.model": 4,
    "mixers.checkpoints": 5, "mixers.report": 5, "mixers.integrations": 6, "mixers.demo": 6, "mixers.training": 7,
    "mixers.cli": 7,
    "mixers.carry": 8, "mixers.__main__": 8, "mixers": 8,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "mixers" else None


def _downward_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, target)`` pairs where a ``mixers`` module imports from a higher room (or a room the
    table does not know, so a new room has to be given its floor)."""
    bad = []
    for name, targets in graph.items():
        room = _room(name)
        if room is None:
            continue
        for target in targets:
            other = _room(target)
            if other is None or other == room:
                continue
            if room not in MIXER_FLOORS or other not in MIXER_FLOORS or MIXER_FLOORS[other] > MIXER_FLOORS[room]:
                bad.append((name, target))
    return sorted(bad)


@pytest.mark.parametrize("graph,arrows", [
    pytest.param({"mixers.ops.x": {"mixers.layers.y"}}, [("mixers.ops.x", "mixers.layers.y")], id="ops-up"),
    pytest.param({"mixers.model.x": {"mixers.demo"}}, [("mixers.model.x", "mixers.demo")], id="model-up"),
    pytest.param({"mixers.serving.x": {"mixers.model"}}, [("mixers.serving.x", "mixers.model")], id="new-room"),
    pytest.param({"mixers.demo.x": {"mixers.model", "mixers.ops.y", "ssm_pack", "torch"}}, [], id="down"),
])
def test_the_floor_finder(graph, arrows):
    assert _downward_violations(graph) == arrows


def test_mixers_rooms_only_import_downward():
    bad = _downward_violations(_graph())
    assert bad == [], f"an import points up the rooms of mixers (or into a room with no floor in MIXER_FLOORS): {bad}"
