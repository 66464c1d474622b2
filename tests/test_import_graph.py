"""The rmt package's modules import each other without cycles (issue 61 item 3).

Every ``import`` of an rmt module counts, also those inside functions (deferred to keep a
command's start light): a deferred import is still an edge of the design, and a cycle hidden
behind one is a cycle. ``if TYPE_CHECKING:`` imports do not run and do not count. An import of
``a.b.c`` is an edge to module ``a.b.c`` (its packages' ``__init__`` aside, as import tools draw
it); ``from a.b import c`` to ``a.b.c`` when that is a module, else to ``a.b``."""

import ast
import pathlib

from conftest import ROOT


def _modules():
    root = pathlib.Path(ROOT)
    out = {}
    for path in sorted((root / "rmt").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree, module, is_package):
    """(imported name, is a ``from`` import of a name) of every import that runs."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield base, alias.name


def import_graph():
    """``{module: set of rmt modules it imports}``."""
    modules = _modules()

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        edges = set()
        for base, name in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            target = f"{base}.{name}" if name and f"{base}.{name}" in modules else resolve(base)
            if target and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph):
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_rmt_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "rmt.config_checks" in import_graph()["rmt.training.cli"]


def test_schema_imports_only_errors():
    """rmt/config.py, the schema, depends on nothing else of rmt."""
    assert import_graph()["rmt.config"] == {"rmt.errors"}
