"""Where a model lives: `model.path` (a built-in name, a local directory, a hub ID) to a directory.

    builtin:tiny-reverse[-turns]  -> built on first use (async_april/models/tiny.py)
    a local Hugging Face directory -> itself
    org/name[@revision]            -> its snapshot in the Hugging Face cache (async_april/models/hub.py)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from async_april.models.hub import parse_hub_id, pinned_commit, resolve_hub_model, snapshot_on_this_node
from async_april.models.tiny import BUILTIN_TASKS, DEFAULT_CACHE_DIR, ensure_tiny_model


def resolve_model_path(path: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """`builtin:tiny-reverse` -> the built tiny model; a local Hugging Face directory; else a hub ID
    `org/name[@revision]` -> its snapshot in the Hugging Face cache (async_april/models/hub.py)."""
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


def model_source(path: str) -> str:
    """`builtin` (built on each node), `local` (a directory: must be shared) or `hub` (each node's own cache)."""
    if path.startswith("builtin:"):
        return "builtin"
    if Path(path).expanduser().is_dir() or parse_hub_id(path) is None or path.startswith((".", "/", "~")):
        return "local"
    return "hub"


def hub_pin(path: str, resolved: str | os.PathLike) -> tuple[str, str] | None:
    """(repo, commit) when `path` is a hub ID the driver resolved to the snapshot `resolved`, else None."""
    if model_source(path) != "hub":
        return None
    commit = pinned_commit(resolved)
    return (parse_hub_id(path)[0], commit) if commit is not None else None


def model_path_on_this_node(model_cfg: Any, driver_path: str | os.PathLike) -> Path:
    """Where this node has the model: the driver's resolved directory when this node sees it
    (one machine, shared storage); for a hub ID, the very commit the driver resolved, from this node's
    own cache (a ModelError naming node, ID, commit and `hf download` if it lacks it); else `model.path`
    resolved here (a built-in model is built on this node)."""
    p = Path(driver_path)
    if (p / "config.json").is_file():
        return p
    pin = hub_pin(model_cfg.path, p)
    if pin is not None:
        return snapshot_on_this_node(*pin, may_download=model_cfg.download_on_nodes, where=this_node())
    return resolve_model_path(model_cfg.path, model_cfg.cache_dir)


def this_node() -> str:
    """`node 3f2a91c0 (10.0.0.7)` inside a Ray worker; `this machine` outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return f"node {ray.get_runtime_context().get_node_id()[:8]} ({ray.util.get_node_ip_address()})"
    except Exception:  # noqa: BLE001 - only a label for a message
        pass
    return "this machine"
