"""Where a model lives: `model.path` (a built-in name, a local directory, a hub ID) to a directory.

    builtin:tiny-reverse[-turns]  -> built on first use (async_april/models/tiny.py)
    a local Hugging Face directory -> itself
    org/name[@revision]            -> its snapshot in the Hugging Face cache (async_april/hub.py)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from async_april.hub import parse_hub_id, resolve_hub_model
from async_april.models.tiny import BUILTIN_TASKS, DEFAULT_CACHE_DIR, ensure_tiny_model


def resolve_model_path(path: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """`builtin:tiny-reverse` -> the built tiny model; a local Hugging Face directory; else a hub ID
    `org/name[@revision]` -> its snapshot in the Hugging Face cache (async_april/hub.py)."""
    if path in BUILTIN_TASKS:
        return ensure_tiny_model(cache_dir, task=BUILTIN_TASKS[path])
    hint = f"set model.path to a Hugging Face model directory, a hub ID (org/name[@revision]) or one of {sorted(BUILTIN_TASKS)}"
    if path.startswith("builtin:"):
        raise ValueError(f"model.path {path!r} is not a built-in model; {hint}")
    local = Path(path).expanduser()
    if not local.is_dir():
        if parse_hub_id(path) is not None and not path.startswith((".", "/", "~")):
            return resolve_hub_model(path)
        raise FileNotFoundError(f"model.path {path!r} does not exist; {hint}")
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path!r} has no config.json; {hint}")
    return local


def model_path_on_this_node(model_cfg: Any, driver_path: str | os.PathLike) -> Path:
    """Where this node has the model: the driver's resolved directory when this node sees it
    (one machine, shared storage), else `model.path` resolved here (hub cache of this node)."""
    p = Path(driver_path)
    if (p / "config.json").is_file():
        return p
    return resolve_model_path(model_cfg.path, model_cfg.cache_dir)
