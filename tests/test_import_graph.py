"""The rmt package's modules import each other without cycles; the runtime does not import the
planner (which imports the runtime's torch-free leaves); no module imports another package's
private names.

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


def _sources():
    """``{module: (is a package's __init__, its source)}`` of every rmt module."""
    return {module: (path.name == "__init__.py", path.read_text()) for module, path in _modules().items()}


def _resolve(name, modules):
    """The module ``name`` is or lies in (``a.b.c`` -> ``a.b`` when ``c`` is a name of it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(sources=None):
    """``{module: set of rmt modules it imports}``."""
    sources = _sources() if sources is None else sources
    graph = {}
    for module, (is_package, text) in sources.items():
        edges = set()
        for base, name in _imports(ast.parse(text), module, is_package):
            target = f"{base}.{name}" if name and f"{base}.{name}" in sources else _resolve(base, sources)
            if target and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


RUNTIME = ("rmt.memory", "rmt.models", "rmt.ops", "rmt.training")
PLANNER_AT_START_UP = "rmt.training.fit"
"""The one runtime module that may import the planner: the start-up fit check, through the
planner's public functions."""


def _within(module, package):
    return module == package or module.startswith(package + ".")


def planner_imports(graph):
    """``"importer -> planner module"`` for every import of ``rmt.planner`` by the runtime
    (:data:`RUNTIME`) outside :data:`PLANNER_AT_START_UP`."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if any(_within(module, p) for p in RUNTIME) and module != PLANNER_AT_START_UP
        for target in targets
        if _within(target, "rmt.planner")
    )


def _package(module, sources):
    return module if sources[module][0] else module.rpartition(".")[0]


def private_imports(sources=None):
    """``"importer -> a.b._name"`` for every import of a private name (one ``_``, not a dunder)
    that another package holds: the name belongs to the module or package before it."""
    sources = _sources() if sources is None else sources
    found = []
    for module, (is_package, text) in sources.items():
        for base, name in _imports(ast.parse(text), module, is_package):
            parts = base.split(".") + ([name] if name else [])
            if parts[0] != "rmt":
                continue
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = _resolve(".".join(parts[:i]), sources)
                    if owner is None or _package(owner, sources) != _package(module, sources):
                        found.append(f"{module} -> {'.'.join(parts[: i + 1])}")
                    break
    return sorted(found)


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


def test_the_runtime_does_not_import_the_planner():
    """rmt/memory, rmt/models and rmt/ops never import rmt.planner, rmt/training only in its
    start-up fit check: what both need (Appendix D's volumes and the partition choice, byte
    sizes, the padded vocabulary) is in torch-free leaves of the runtime that the planner imports."""
    assert planner_imports(import_graph()) == []


def test_no_module_imports_a_private_name_of_another_package():
    assert private_imports() == []


def test_the_checks_find_what_they_forbid():
    sources = {
        "rmt": (True, ""),
        "rmt.planner": (True, ""),
        "rmt.planner.flops": (False, "def _pad(v, m): ...\ndef plan(): ..."),
        "rmt.planner.rank": (False, "from rmt.planner.flops import _pad"),
        "rmt.memory": (True, ""),
        "rmt.memory.table": (False, "def f():\n    from rmt.planner.flops import plan"),
        "rmt.training": (True, ""),
        "rmt.training.fit": (False, "from rmt.planner.flops import _pad, plan"),
        "rmt.training.loop": (False, "import rmt.planner.flops"),
    }
    assert planner_imports(import_graph(sources)) == [
        "rmt.memory.table -> rmt.planner.flops",
        "rmt.training.loop -> rmt.planner.flops",
    ]
    assert private_imports(sources) == ["rmt.training.fit -> rmt.planner.flops._pad"]
