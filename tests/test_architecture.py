"""Architecture: the import graph of ``src/crispedit`` has no cycles and no upward imports.

The graph is read from the source with :mod:`ast` (no module is imported: fast, torch-free). Every
``import crispedit...`` and ``from crispedit... import ...`` counts, relative imports too (resolved to
absolute module names), wherever they stand: at module level, inside functions (the lazy imports that keep
the command line torch-free), under ``if TYPE_CHECKING``. An edge goes to the module the statement names:
``from pkg import sub`` to ``pkg.sub`` when that is a module, ``from pkg import name`` to ``pkg`` — or, when
``pkg`` exports ``name`` lazily (``_lazy.lazy_exports``), to the submodule that defines it. Parent packages
whose ``__init__`` Python runs on the way are not edges of their own, and neither are imports by name
string (``importlib.import_module``): the command modules the CLI lists (``cli._COMMAND_MODULES``), and the
method registry's lookups — the built-in methods' package ``crispedit.methods`` (``registry.BUILTINS``) and
each method's editor class (``MethodSpec.editor``), which the registry finds by name because the methods sit
above it (a plugin lookup, not an import statement).

The layers, lowest first (:data:`LAYERS`; a module may import from its own layer and those below):

1. ``base`` — what everything uses: errors, version stamps, checks of numbers and paths, the settings base,
   atomic writes, the safetensors reader, progress, lazy exports, per-family defaults, the ``torch.distributed``
   helpers, the delta file's header format, model loading, layer patterns, weights and their fingerprint, forward
   arguments, edit and text data.
2. ``curvature`` — the capability loss's curvature (K-FAC, EK-FAC, exact), the cache, the predicted drift and
   the projectors built from it: maths on a model, nothing about edits.
3. ``evaluation`` — measures a model (teacher-forced, WILD, capabilities, KL drift); it never edits, so
   whatever edits can evaluate.
4. ``editing`` — the machinery every method shares: the registry and configs, the editor interface, the
   projected loop and its fast path, contexts, optimiser, key-value and gradient-row collectors, batch ``edit``.
5. ``methods`` — the editors, one module or package each, built on that machinery.
6. ``jobs`` — ``delta`` (reversible delta files), ``pipeline`` (one edit job — edit, evaluate —, the output
   directory and its report), ``model_card`` (the README.md of a saved model), ``export_gguf`` (a model directory as
   one GGUF file) and ``gguf_fields`` (its tokenizer, names and provenance): what an edit leaves behind.
7. ``sessions`` — sequential rounds and durable sessions (they edit, evaluate and write deltas).
8. ``experiments`` — studies built on whole jobs and sessions (``compare``, the MNIST study), the demo and
   the playground (a local web page that asks, edits and undoes on one model).
9. ``cli`` — parses, calls the library, prints.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "crispedit"

# (layer name, the packages and modules in it), lowest first; see the module docstring for what each holds.
# The package's own ``__init__`` ("crispedit") is named exactly; every other entry covers its submodules too.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "crispedit",
            "crispedit._lazy",
            "crispedit.errors",
            "crispedit.versions",
            "crispedit.checks",
            "crispedit.settings",
            "crispedit.paths",
            "crispedit.atomic",
            "crispedit.safetensors_io",
            "crispedit.progress",
            "crispedit.families",
            "crispedit.distributed",
            "crispedit.delta_format",
            "crispedit.models",
            "crispedit.layers",
            "crispedit.weights",
            "crispedit.forward_args",
            "crispedit.forward_parts",
            "crispedit.data",
        ),
    ),
    ("curvature", ("crispedit.curvature",)),
    ("evaluation", ("crispedit.evaluation",)),
    ("editing", ("crispedit.editing",)),
    ("methods", ("crispedit.methods",)),
    (
        "jobs",
        (
            "crispedit.delta",
            "crispedit.pipeline",
            "crispedit.model_card",
            "crispedit.export_gguf",
            "crispedit.gguf_fields",
        ),
    ),
    ("sessions", ("crispedit.sessions",)),
    ("experiments", ("crispedit.experiments", "crispedit.demo", "crispedit.playground")),
    ("cli", ("crispedit.cli", "crispedit.__main__")),
)


def module_files(root: Path) -> dict[str, Path]:
    """Absolute module name -> file of every module of the package in directory ``root`` (a package's
    ``__init__.py`` is the package's own name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module name of ``from <level dots><name> import ...`` written in ``module``."""
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1:
        base = base[: -(level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal_exports(node: ast.expr, tree: ast.Module) -> dict[str, str]:
    """The ``{name: relative module}`` map given to ``lazy_exports``: a dict display of string pairs and
    ``**dict.fromkeys([names], module)`` parts, or the name of a module-level variable holding one."""
    if isinstance(node, ast.Name):
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in stmt.targets):
                return _literal_exports(stmt.value, tree)
        raise AssertionError(f"lazy_exports map {node.id!r} is not assigned at module level")
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:  # **part
                out.update(_literal_exports(value, tree))
            else:
                out[ast.literal_eval(key)] = ast.literal_eval(value)
        return out
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "fromkeys"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "dict"
    ):
        return dict.fromkeys(ast.literal_eval(node.args[0]), ast.literal_eval(node.args[1]))
    raise AssertionError(f"cannot read the lazy_exports map at line {node.lineno}: {ast.unparse(node)}")


def lazy_exports_of(package: str, tree: ast.Module) -> dict[str, str]:
    """Name -> absolute module for what package ``package`` (its ``__init__`` parsed as ``tree``) exports
    through ``lazy_exports(__name__, MAP)``; empty when it does not."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "lazy_exports"
            and len(node.args) == 2
        ):
            return {
                name: _resolve(package, True, len(where) - len(where.lstrip(".")), where.lstrip(".") or None)
                for name, where in _literal_exports(node.args[1], tree).items()
            }
    return {}


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for what counts as an edge)."""
    files = module_files(root)
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in files.items()}
    lazy = {name: lazy_exports_of(name, tree) for name, tree in trees.items() if files[name].name == "__init__.py"}
    top = root.name

    def known(name: str) -> str | None:
        """``name`` or its longest prefix that is a module of the package; None outside the package."""
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        is_package = files[module].name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name == top or a.name.startswith(top + ".")}
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                if source != top and not source.startswith(top + "."):
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in files:
                        edges.add(f"{source}.{alias.name}")
                    else:
                        edges.add(lazy.get(source, {}).get(alias.name) or known(source))
        edges.discard(None)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(comp, graph) for comp in components]


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, staying inside the component."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component {component}")  # pragma: no cover


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, f"found only {len(graph)} modules under {SRC}"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_has_the_edges_it_should():
    graph = import_graph()
    assert "crispedit.delta_format" in graph["crispedit.delta"]  # module level, relative
    assert "crispedit.delta" in graph["crispedit.cli.delta"]  # inside a function
    assert "crispedit.experiments.mnist_study" in graph["crispedit.cli.mnist"]
    assert "crispedit.methods.memit" in graph["crispedit.methods.memit.editor"]  # `from . import MEMITConfig`
    assert graph["crispedit.editing"] == {"crispedit._lazy"}  # lazy exports are no edges of the package itself
    # lazy exports
    assert {"crispedit.editing.config", "crispedit.editing.api"} <= graph["crispedit.experiments.compare"]
    assert "crispedit.editing" not in graph["crispedit.experiments.compare"]
    assert "crispedit.data" in graph["crispedit.demo"]  # a plain package re-export
    assert {"crispedit.data.corpus", "crispedit.data.edits"} <= graph["crispedit.data"]
    assert "crispedit.checks" in graph["crispedit.experiments.mnist_config"]  # two dots


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """``(index, name)`` of the layer holding ``module``: the entry that names it or its longest enclosing
    package (a top-level package entry, one without a dot, names only itself); ``None`` when no entry does."""
    best = None
    for i, (name, entries) in enumerate(layers):
        for entry in entries:
            covers = module == entry or ("." in entry and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > best[0]):
                best = (len(entry), (i, name))
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every edge of ``graph`` that goes to a higher layer than its module's, as ``"a (layer) -> b (layer)"``."""
    out = []
    for module, edges in sorted(graph.items()):
        here = layer_of(module, layers)
        for target in sorted(edges):
            there = layer_of(target, layers)
            if here is not None and there is not None and there[0] > here[0]:
                out.append(f"{module} ({here[1]}) -> {target} ({there[1]})")
    return out


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, (
        "modules in no layer (add them to LAYERS in tests/test_architecture.py, where they "
        "belong):\n" + "\n".join(missing)
    )


def test_no_module_imports_from_a_layer_above():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_what_it_should():
    layers = (("low", ("pkg", "pkg.a", "pkg.sub.deep")), ("mid", ("pkg.sub",)), ("high", ("pkg.top",)))
    assert layer_of("pkg", layers) == (0, "low") and layer_of("pkg.a.x", layers) == (0, "low")
    assert layer_of("pkg.sub.b", layers) == (1, "mid") and layer_of("pkg.sub.deep.c", layers) == (0, "low")
    assert layer_of("pkg.other", layers) is None  # the top-level entry names the package's __init__ only
    graph = {
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.a", "pkg.sub.deep"},
        "pkg.top": {"pkg.sub.b", "pkg"},
        "pkg.sub.deep": {"pkg.top"},
    }
    assert upward_imports(graph, layers) == ["pkg.a (low) -> pkg.sub.b (mid)", "pkg.sub.deep (low) -> pkg.top (high)"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_check_sees_what_it_should(tmp_path):
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "from ._lazy import lazy_exports\n"
            "__getattr__, __dir__ = lazy_exports(__name__, {'f': '.a', **dict.fromkeys(['g'], '.sub.c')})\n",
            "_lazy.py": "import os\n",
            "a.py": "import pkg.sub.b\nimport json\n",
            "sub/__init__.py": "",
            "sub/b.py": "def f():\n    from ..a import x\n    from . import c\n",
            "sub/c.py": "from pkg import f, g\nfrom pkg.sub import b as bb\nfrom .. import _lazy\n",
            "d.py": "if True:\n    from .sub.c import y\nimport pkg.sub.c.attr\n",
        },
    )
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg._lazy"},
        "pkg._lazy": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.a", "pkg.sub.b", "pkg._lazy"},
        "pkg.d": {"pkg.sub.c"},
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z", "x"]]
    assert find_cycles({"x": {"y"}, "y": set()}) == []
