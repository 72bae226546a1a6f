"""docs/architecture.md's file map ("Concepts to files") names every module of async_april/, actors/ and
learners/ exactly once, and no file that does not exist: a module added, moved or removed fails here
until the map is redrawn."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("async_april", "actors", "learners")


def named_in_map() -> list[str]:
    """Every .py path in the map's `files` column; `dir/{a,b}.py` is expanded."""
    doc = (REPO / "docs/architecture.md").read_text()
    table = doc.split("## Concepts to files", 1)[1].split("\n## ", 1)[0]
    out = []
    for row in table.splitlines():
        if not row.startswith("|") or row.startswith("|---"):
            continue
        files = row.rstrip(" |").rsplit("|", 1)[-1]
        for path in re.findall(r"`([\w/.{},]+\.py)`", files):
            if m := re.fullmatch(r"(.*)\{([\w,]+)\}\.py", path):
                out += [f"{m.group(1)}{name}.py" for name in m.group(2).split(",")]
            else:
                out.append(path)
    return out


def test_every_module_is_in_the_file_map_once():
    on_disk = {str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    named = Counter(named_in_map())
    assert not (missing := sorted(on_disk - set(named))), f"modules the map does not name: {missing}"
    assert not (gone := sorted(set(named) - on_disk)), f"the map names files that do not exist: {gone}"
    assert not (twice := sorted(p for p, n in named.items() if n > 1)), f"named more than once: {twice}"


def test_the_core_is_in_rooms_each_saying_what_it_holds():
    """Issue 39: at most ~12 modules loose at the top of async_april/; each folder's __init__ docstring says
    the one idea it holds."""
    import ast

    loose = sorted(p.name for p in (REPO / "async_april").glob("*.py"))
    assert len(loose) <= 12, loose
    for init in (REPO / "async_april").glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(REPO)} has no docstring"


def test_no_module_is_over_400_lines():
    """Issue 39: a module that outgrows 400 lines holds more than one idea; split it along the idea,
    as store_report.py, rank_setup.py, pool_pending.py and LaunchedServer (sglang_process.py) were."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    assert not (big := sorted(f"{p} ({n})" for p, n in sizes.items() if n > 400)), f"over 400 lines: {big}"
