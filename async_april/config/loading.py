"""From YAML files and dotted overrides to a validated `Config`, and back to `config.yaml`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from async_april.config.base import ConfigError
from async_april.config.root import Config
from async_april.errors import short_repr
from async_april.run.masking import mask_config
from async_april.structured import DuplicateKeyError, NestingError, load_yaml

OVERRIDES_HELP = "dotted overrides, e.g. rollout.n_samples=4 async.max_staleness=2 (docs/configuration.md)"
"""Help text of the KEY=VALUE arguments of every command that takes a config."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    """One line: `invalid config (SOURCE): key: problem (got VALUE); key: ...`."""
    parts = []
    for e in err.errors()[:8]:  # bounded: the first eight problems name enough to fix
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        key = key.replace("async_", "async")
        if e["type"] == "extra_forbidden":
            parts.append(f"{key}: unknown key (value {short_repr(e['input'])}); check the spelling against docs/configuration.md")
        elif e["type"] == "value_error":  # a check across keys: its message names them
            parts.append(e["msg"].removeprefix("Value error, "))
        else:
            parts.append(f"{key}: {e['msg']} (got {short_repr(e['input'])})")
    return f"invalid config ({source}): " + "; ".join(parts)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`rollout.n_samples=8` -> (["rollout", "n_samples"], 8). Values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        return path, load_yaml(raw) if raw.strip() else None
    except (NestingError, DuplicateKeyError) as e:
        raise ConfigError(f"override {short_repr(item, 80)}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {short_repr(item, 200)}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                          "write a string value in YAML quotes") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (None means all defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        data = _resolve_presets(read_yaml(p, "config file"), p.parent, (p.resolve(),))
        source = str(p)
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + overrides"
    return config_from_dict(data, source)


def _resolve_presets(data: dict[str, Any], base: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """`defaults: [presets/async.yaml]` merges those files first, then this one on top. `chain`: the files
    being included, outermost first (a file reached again through its own defaults is a cycle)."""
    includes = data.pop("defaults", None) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict[str, Any] = {}
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"`defaults` must be a list of YAML file paths, e.g. [presets/async.yaml], got {short_repr(includes)}")
    for inc in includes:
        inc_path = (base / inc).resolve()
        if not inc_path.is_file():
            raise ConfigError(f"defaults entry {inc!r} not found at {str(inc_path)!r}")
        if inc_path in chain:
            loop = " -> ".join(p.name for p in (*chain[chain.index(inc_path):], inc_path))
            raise ConfigError(f"defaults entry {inc!r} in {str(chain[-1])!r} includes a file that includes it back "
                              f"({loop}); remove one of these defaults entries")
        _deep_merge(merged, _resolve_presets(read_yaml(inc_path, f"defaults entry {inc!r}"), inc_path.parent,
                                             (*chain, inc_path)))
    _deep_merge(merged, data)
    return merged


def read_yaml(p: Path, what: str) -> dict[str, Any]:
    """The mapping in YAML file `p`, or a ConfigError naming the file, the line and the problem."""
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        text = p.read_text(encoding="utf-8")
        loaded = load_yaml(text)  # bounded depth and aliases, duplicated keys refused (async_april/structured.py)
    except (NestingError, DuplicateKeyError) as e:
        raise ConfigError(f"{what} {str(p)!r}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{what} {str(p)!r}:{where}: YAML syntax error: {problem}; fix the file") from None
    if loaded is None:
        raise ConfigError(f"{what} {str(p)!r} is empty; give at least one section (write `{{}}` for all defaults)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {str(p)!r} must hold a mapping of sections (run:, model:, ...), "
                          f"got a {type(loaded).__name__}")
    return loaded


def _deep_merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


def save_config(cfg: Config, run_dir: Path) -> Path:
    """Write the resolved config as run_dir/config.yaml, every secret in it masked (async_april/run/masking.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(yaml.safe_dump(mask_config(cfg.to_yaml_dict()), sort_keys=False))
    return out
