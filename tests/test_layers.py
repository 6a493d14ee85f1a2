"""The house: no import circle among verispec's modules (function-level imports included), small modules, a library
that does not import its server, and a step that fits a screen."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "verispec"


def import_graph() -> dict[str, set[str]]:
    """module -> the verispec modules it imports anywhere in its source (TYPE_CHECKING blocks aside)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        type_only = {
            id(node) for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for after in sorted(graph[node]):
            if state.get(after) == 1:
                return path[path.index(after):] + [after]
            if after not in state and (cycle := visit(after)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    graph = import_graph()
    assert "verispec.models.machine" in graph["verispec.models.loading"]  # the graph sees real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


MOST_LINES = 600  # a module a newcomer can read through
STEP_MOST_LINES = 60  # the step, plan to commit, in one screen
FRONT_DOORS = ("verispec.serving", "verispec.cli")  # the server and the command line may import the server


def test_no_module_is_over_the_line_limit():
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py") if (lines := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"modules over {MOST_LINES} lines: {long}"


def test_the_library_does_not_import_the_server():
    graph = import_graph()
    library = [name for name in graph if not name.startswith(FRONT_DOORS)]
    assert "verispec.engine" in library and "verispec.core.scheduler" in library
    importers = {name: sorted(t for t in graph[name] if t.startswith("verispec.serving")) for name in library}
    assert not {name: targets for name, targets in importers.items() if targets}


def test_the_step_fits_a_screen():
    from verispec.core.step import Stepping

    lines, _ = inspect.getsourcelines(Stepping._step)
    assert 10 < len(lines) <= STEP_MOST_LINES, f"Stepping._step is {len(lines)} lines"
