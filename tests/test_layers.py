"""The project's layers, read from its own imports (ast; no third-party tool, nothing imported).

    launch   async_april/launch/ (+ the entry points async_april/__main__.py, async_april/train.py)
      |  wires the layers below into a run: controller, evaluator, resolve, cli and its commands
      v
    actors/   learners/      generation, engines, agents  |  FSDP2 ranks, checkpoints, weight push
      |  neither imports the other: what both need (the weight-bucket format, the environment
      v  protocol) lives in the core
    core     async_april/ (everything else): config, data, trajectory, store, staleness, algorithms, ...

Every import counts, wherever it is written: at the top, inside a function, or under TYPE_CHECKING.
An import circle is refused too, even inside one layer: break it by moving the shared piece down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("async_april", "actors", "learners")
ENTRY_POINTS = {"async_april.__main__", "async_april.train"}
"""Modules of the core's directory that belong to the launch layer: `python -m` names kept for users."""


def module_files(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (`a.b.c` -> `a.b` when c is an attribute)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {o for n in names if (o := _owner(n, mods)) and o != mod}
        graph[mod] = deps
    return graph


def layer(mod: str) -> str:
    if mod.startswith("async_april.launch") or mod in ENTRY_POINTS:
        return "launch"
    return mod.split(".")[0].replace("async_april", "core")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        cycles.append(sorted(comp))
    return cycles


ALLOWED = {"core": {"core"}, "actors": {"core", "actors"}, "learners": {"core", "learners"},
           "launch": {"core", "actors", "learners", "launch"}}
"""Which layers each layer may import."""


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files())


def test_no_import_circle_among_the_projects_modules(graph):
    assert import_cycles(graph) == []


def test_each_layer_imports_only_the_layers_below_it(graph):
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) not in ALLOWED[layer(m)])
    assert upward == []


def test_the_reader_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """A circle closed by a relative import, one inside a function and one under TYPE_CHECKING is found,
    and a core module importing the actors is refused: the two tests above can fail."""
    pkg = tmp_path / "async_april"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "actors").mkdir()
    files = {
        "async_april/__init__.py": "",
        "async_april/sub/__init__.py": "",
        "async_april/sub/a.py": "from . import b\n",
        "async_april/sub/b.py": "def f():\n    from async_april.sub.c import g\n",
        "async_april/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from async_april.sub.a import X\n",
        "async_april/d.py": "import actors.e\n",
        "actors/__init__.py": "",
        "actors/e.py": "from async_april.d import thing\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    g = import_graph(module_files(tmp_path, ("async_april", "actors")))
    assert g["async_april.sub.a"] == {"async_april.sub", "async_april.sub.b"}
    assert import_cycles(g) == [["actors.e", "async_april.d"], ["async_april.sub.a", "async_april.sub.b", "async_april.sub.c"]]
    assert "actors" not in ALLOWED[layer("async_april.d")] and layer("actors.e") == "actors"
    assert layer("async_april.train") == "launch" and layer("async_april.launch.cli") == "launch"
