"""Render docs/configuration.md from the config classes' field docstrings.

    python -m async_april.config_docs          # rewrite docs/configuration.md
    python -m async_april.config_docs --check  # exit 1 if it is out of date (tests do this)
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from async_april.config import Config

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from the docstrings in `async_april/config/` by
`python -m async_april.config_docs`; a test fails when this file is out of date.

A run is one YAML file (data only) plus dotted overrides on the command line:

    async-april train configs/tiny_cpu.yaml rollout.n_samples=4 async.max_staleness=2

A file may start with `defaults: [presets/async.yaml]` to merge presets first.
Unknown keys, wrong types and out-of-range values are rejected before any actor
starts, naming the key, the value and what is allowed. The resolved config is
saved as `config.yaml` in the run directory.
"""


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(parts)


def render() -> str:
    out = [HEADER]
    for name, field in Config.model_fields.items():
        section = field.alias or name
        cls: type[BaseModel] = field.annotation
        out.append(f"\n## `{section}`\n\n{field.description}\n")
        _table(out, section, cls)
    return "\n".join(out) + "\n"


def _table(out: list[str], prefix: str, cls: type[BaseModel]) -> None:
    """One table per section; a nested section (rollout.sglang) or a list of sections
    (eval.datasets) gets a table of its own after it."""
    out.append("| key | type | default | bounds | meaning |\n|---|---|---|---|---|")
    nested, listed = [], []
    for key, f in cls.model_fields.items():
        desc = (f.description or "").replace("\n", " ").replace("|", "\\|")
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out.append(f"| `{prefix}.{key}` | section | | | {desc} See `{prefix}.{key}` below. |")
            nested.append((f"{prefix}.{key}", f.annotation))
            continue
        item = typing.get_args(f.annotation)[0] if typing.get_origin(f.annotation) is list else None
        if isinstance(item, type) and issubclass(item, BaseModel):
            listed.append((f"{prefix}.{key}", item))
        default = "required" if f.is_required() else repr(f.default if f.default_factory is None else f.default_factory())
        out.append(f"| `{prefix}.{key}` | {_type_name(f.annotation)} | `{default}` | {_bounds(f)} | {desc} |")
    for name, sub in nested:
        out.append(f"\n### `{name}`\n\n{(sub.__doc__ or '').strip()}\n")
        _table(out, name, sub)
    for name, item in listed:
        out.append(f"\nEach entry of `{name}`: {(item.__doc__ or '').strip()}\n")
        _table(out, f"{name}[]", item)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is out of date; run: python -m async_april.config_docs", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
