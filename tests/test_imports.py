"""No import cycles in `glm52_jax`, between modules or between (sub)packages.

Every module is parsed with `ast` (nothing is imported) and every import statement counts,
including deferred ones inside functions and `if TYPE_CHECKING:` blocks: a deferred import is
still a dependency, and hiding a cycle inside a function does not remove it. Relative imports are
resolved, and `from pkg import name` points at the submodule `pkg.name` when there is one, else at
`pkg` (its `__init__`).

Graphs:
- module graph: node = module (`glm52_jax.model.moe`; a package's `__init__` is the package name);
- package graph: node = the subpackage a module lives in (`glm52_jax.model`, `glm52_jax.rl.rewards`);
  a module directly in `glm52_jax/` (`config`, `plan`, ...) is its own node. Edges inside one node
  are dropped.

Edges into the root package `glm52_jax` (`import glm52_jax`, `from glm52_jax import load_pretrained`)
are ignored: its `__init__` imports no package module when it runs; its exports load through
`importlib` on first attribute access, after every importing module has finished loading, so they
cannot take part in an import-time cycle (`test_root_init_only_reexports_lazily` keeps that true).
Otherwise every module would depend on the model through the root, and the model on everything
importing the root.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import glm52_jax

PACKAGE_DIR = Path(glm52_jax.__file__).resolve().parent


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """`{dotted module name: file}` for every `.py` file under `package_dir`."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """The modules one import statement in `module` names (absolute; possibly outside the package)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:  # relative: level 1 is the module's own package
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        if keep <= 0:
            raise ValueError(f"{module}: relative import beyond the top-level package")
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    else:
        base = node.module
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in known else base


def _owner(name: str, known: set[str]) -> str | None:
    """The package module that `name` (a module, or an attribute path below one) belongs to."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def module_graph(package_dir: Path, package: str, ignore: Iterable[str] = ()) -> dict[str, set[str]]:
    """`{module: modules of the package it imports}`, from every import statement in its source."""
    files = module_names(package_dir, package)
    known, skip = set(files), set(ignore)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, _is_package(path), known):
                    owner = _owner(name, known)
                    if owner is not None and owner not in skip:
                        targets.add(owner)
        graph[module] = targets
    return graph


def package_graph(modules: dict[str, set[str]], package_dir: Path, package: str) -> dict[str, set[str]]:
    """Collapse the module graph onto subpackages (a top-level module is its own node)."""
    files = module_names(package_dir, package)

    def node(module: str) -> str:
        path = files[module]
        if _is_package(path) or path.parent == package_dir:
            return module
        return module.rpartition(".")[0]

    graph: dict[str, set[str]] = {}
    for module, targets in modules.items():
        edges = graph.setdefault(node(module), set())
        edges.update(node(t) for t in targets)
    for name, edges in graph.items():
        edges.discard(name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path `[a, b, ..., a]` per strongly connected component that has a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(min(c), c, graph) for c in components]


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component (BFS)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:  # walk back v -> ... -> start, then close the loop
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component {sorted(component)}")


def _format(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


@pytest.fixture(scope="module")
def modules():
    return module_graph(PACKAGE_DIR, "glm52_jax", ignore=("glm52_jax",))


def test_no_module_cycles(modules):
    cycles = find_cycles(modules)
    assert not cycles, "import cycles between modules:\n" + _format(cycles)


def test_no_package_cycles(modules):
    cycles = find_cycles(package_graph(modules, PACKAGE_DIR, "glm52_jax"))
    assert not cycles, "import cycles between packages:\n" + _format(cycles)


def test_parallel_is_the_bottom_layer(modules):
    """`glm52_jax.parallel` (mesh, rules, placement, distributed) imports nothing else of the package."""
    outside = {f"{m} -> {t}" for m, ts in modules.items() if m.startswith("glm52_jax.parallel")
               for t in ts if not t.startswith("glm52_jax.parallel")}
    assert not outside, sorted(outside)


def test_graph_sees_the_known_edges(modules):
    """The real package's graph has the edges its sources state (deferred and relative imports: the fake
    packages below)."""
    assert "glm52_jax.positions" in modules["glm52_jax.model.mla"]  # from glm52_jax import positions as ...
    assert "glm52_jax.model.expert_parallel" in modules["glm52_jax.model.moe"]
    assert "glm52_jax.evidence.receipt" in modules["glm52_jax.evidence"]  # a package __init__ as importer
    assert not any(t == "glm52_jax" for ts in modules.values() for t in ts)  # ignored, see the module doc


def test_root_init_only_reexports_lazily():
    """The reason edges into `glm52_jax` are ignored: its `__init__` imports nothing from the package when it
    runs, and every lazy export names a module of the package."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"importlib", "__future__"}, imported
    known = set(module_names(PACKAGE_DIR, "glm52_jax"))
    assert set(glm52_jax._EXPORTS.values()) <= known


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "fake"


FAKE = {
    "fake/__init__.py": "",
    "fake/top.py": "import os\n",
    "fake/a/__init__.py": "",
    "fake/a/one.py": "from fake.b import two\n",  # module-level, `from pkg import submodule`
    "fake/a/three.py": "from . import one\nfrom ..top import os\n",  # relative; an attribute of fake.top
    "fake/b/__init__.py": "",
    "fake/b/two.py": "def f():\n    from ..a.three import g\n",  # deferred and relative
    "fake/c/__init__.py": "",
    "fake/c/four.py": "import fake.a.one\n",
    "fake/c/d/__init__.py": "",
    "fake/c/d/five.py": "from fake.c import four\n",
}


def test_checker_finds_a_module_cycle(tmp_path):
    pkg = _write(tmp_path, FAKE)
    graph = module_graph(pkg, "fake")
    assert graph["fake.a.three"] == {"fake.a.one", "fake.top"}
    assert graph["fake.c.four"] == {"fake.a.one"}
    assert find_cycles(graph) == [["fake.a.one", "fake.b.two", "fake.a.three", "fake.a.one"]]


def test_checker_finds_a_package_cycle(tmp_path):
    """a.one -> b.two is a package cycle a -> b -> a even when the modules' own cycle is broken."""
    files = dict(FAKE, **{"fake/a/three.py": "from ..top import os\n"})
    pkg = _write(tmp_path, files)
    graph = module_graph(pkg, "fake")
    assert find_cycles(graph) == []
    packages = package_graph(graph, pkg, "fake")
    assert packages["fake.c.d"] == {"fake.c"} and packages["fake.c"] == {"fake.a"}
    assert packages["fake.a"] == {"fake.b", "fake.top"}
    assert find_cycles(packages) == [["fake.a", "fake.b", "fake.a"]]


def test_checker_finds_a_self_import_and_passes_a_dag(tmp_path):
    pkg = _write(tmp_path / "dag", {"fake/__init__.py": "", "fake/x.py": "from fake import y\n",
                                    "fake/y.py": "import json\n"})
    assert find_cycles(module_graph(pkg, "fake")) == []
    pkg = _write(tmp_path / "self", {"fake/__init__.py": "", "fake/x.py": "def f():\n    import fake.x\n"})
    assert find_cycles(module_graph(pkg, "fake")) == [["fake.x", "fake.x"]]
