"""State without pickle: a tree of plain data as JSON, its arrays in a safetensors file.

Checkpoints must load without running code, so nothing here unpickles.
`save(obj, dir, name)` writes `name.json` (the tree, schema `async-april/state`
version 1) and `name.safetensors` (every array); `load(dir, name)` rebuilds the
object. Accepted types, and nothing else (a TypeError naming the path at save time):

    None, bool, int, float (nan/inf tagged), str, list, tuple, dict (keys of these
    types), collections.deque and Counter, numpy arrays and scalars, torch tensors,
    and the dataclasses listed in ALLOWED_DATACLASSES (rebuilt field by field).

A JSON value that is not plain data is tagged as an object with one `$` key:
`{"$tuple": [...]}`, `{"$nd": "key"}` (numpy array stored under `key`), `{"$pt":
"key"}` (torch tensor), `{"$dc": "module:Class", "fields": {...}}`. An array
object reached twice (the n samples of a group share their prompt ids) is stored
once and comes back shared.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

import numpy as np

SCHEMA = "async-april/state"
VERSION = 1

ALLOWED_DATACLASSES = frozenset({
    "async_april.rollout.trajectory:Sample",
    "async_april.rollout.trajectory:Group",
    "async_april.rollout.store:_Counters",
})
"""Dataclasses a checkpoint may hold. Add a class here to checkpoint it; nothing else is ever imported on load."""

MOVED_DATACLASSES = {
    "async_april.trajectory:Sample": "async_april.rollout.trajectory:Sample",
    "async_april.trajectory:Group": "async_april.rollout.trajectory:Group",
    "async_april.store:_Counters": "async_april.rollout.store:_Counters",
}
"""Where a checkpointed class lives now (issue 39 moved the core into folders): checkpoints written before
the move name the old module and still load."""

Fetch = Callable[[dict], Any]
"""Returns the array for an array tag (`{"$nd": key}`, `{"$pt": key}`, or a caller's own tag)."""

LeafHook = Callable[[str, Any, dict], "dict | None"]
"""`hook(path, value, arrays)` may store `value` itself (into `arrays`) and return its tag; None: the default."""


class StateFormatError(ValueError):
    """A state file that is not this schema, or not this version of it."""


def _torch():
    return sys.modules.get("torch")  # a tensor can only exist if torch is imported; never import it here


def encode(obj: Any, hook: LeafHook | None = None) -> tuple[Any, dict[str, Any]]:
    """(JSON-able tree, {key: array}) for `obj`."""
    arrays: dict[str, Any] = {}
    seen: dict[int, dict] = {}

    def enc(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int) and not isinstance(x, bool):
            return int(x)
        if isinstance(x, float):
            return x if math.isfinite(x) else {"$float": repr(x)}
        if hook is not None and (tag := hook(path, x, arrays)) is not None:
            return tag
        if isinstance(x, np.ndarray) or ((t := _torch()) is not None and isinstance(x, t.Tensor)):
            if id(x) in seen:
                return seen[id(x)]
            kind = "$nd" if isinstance(x, np.ndarray) else "$pt"
            if kind == "$nd" and x.dtype == object:
                raise TypeError(f"{path}: numpy array of Python objects cannot be checkpointed without pickle")
            arrays[path] = x
            seen[id(x)] = {kind: path}
            return seen[id(x)]
        if isinstance(x, np.generic):
            return {"$np": x.dtype.name, "v": enc(x.item(), path)}
        if isinstance(x, tuple):
            return {"$tuple": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, deque):
            return {"$deque": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, Counter):
            return {"$counter": [[enc(k, f"{path}/k{i}"), enc(v, f"{path}/{i}")] for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: enc(v, f"{path}/{k}") for k, v in x.items()}
            return {"$dict": [[enc(k, f"{path}/k{i}"), enc(v, f"{path}/{k}")] for i, (k, v) in enumerate(x.items())]}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            name = f"{type(x).__module__}:{type(x).__qualname__}"
            if name not in ALLOWED_DATACLASSES:
                raise TypeError(f"{path}: dataclass {name} is not in state_codec.ALLOWED_DATACLASSES")
            return {"$dc": name, "fields": {f.name: enc(getattr(x, f.name), f"{path}/{f.name}") for f in dataclasses.fields(x)}}
        raise TypeError(f"{path}: a {type(x).__module__}.{type(x).__qualname__} cannot be checkpointed without pickle")

    return enc(obj, ""), arrays


def decode(tree: Any, fetch: Fetch) -> Any:
    """The object `encode` was given; array tags are resolved by `fetch` (each key once)."""
    cache: dict[str, Any] = {}

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if not any(k.startswith("$") for k in x):
            return {k: dec(v) for k, v in x.items()}
        if "$float" in x:
            return float(x["$float"])
        if "$np" in x:
            return np.dtype(x["$np"]).type(dec(x["v"]))
        if "$tuple" in x:
            return tuple(dec(v) for v in x["$tuple"])
        if "$deque" in x:
            return deque(dec(v) for v in x["$deque"])
        if "$counter" in x:
            return Counter({dec(k): dec(v) for k, v in x["$counter"]})
        if "$dict" in x:
            return {_hashable(dec(k)): dec(v) for k, v in x["$dict"]}
        if "$dc" in x:
            return _dataclass(x["$dc"], {k: dec(v) for k, v in x["fields"].items()})
        key = json.dumps(x, sort_keys=True)
        if key not in cache:
            cache[key] = fetch(x)
        return cache[key]

    return dec(tree)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, (list, tuple)) else k


def _dataclass(name: str, fields: dict[str, Any]) -> Any:
    name = MOVED_DATACLASSES.get(name, name)
    if name not in ALLOWED_DATACLASSES:
        raise StateFormatError(f"state names dataclass {name!r}, which is not in state_codec.ALLOWED_DATACLASSES")
    module, _, qualname = name.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:  # setattr would take any name: a crafted field could shadow a method with data
        raise StateFormatError(f"state gives {name} fields it does not have: {', '.join(map(repr, unknown[:5]))}")
    obj = cls.__new__(cls)  # field by field: no __init__/__post_init__ side effects on restore
    for f in dataclasses.fields(cls):  # a field added after the state was written gets its default
        if f.name not in fields and f.default is not dataclasses.MISSING:
            setattr(obj, f.name, f.default)
        elif f.name not in fields and f.default_factory is not dataclasses.MISSING:
            setattr(obj, f.name, f.default_factory())
    for k, v in fields.items():
        setattr(obj, k, v)
    return obj


# ----------------------------------------------------------------------------- files


def save(obj: Any, directory: str | Path, name: str, hook: LeafHook | None = None, meta: dict | None = None) -> list[Path]:
    """Write `name.json` + `name.safetensors` under `directory`; returns both paths. Not fsynced
    (the checkpoint writer fsyncs its whole directory once, before the rename)."""
    directory = Path(directory)
    tree, arrays = encode(obj, hook)
    torch = _torch()
    framework = "pt" if torch is not None and any(isinstance(a, torch.Tensor) for a in arrays.values()) else "np"
    tensors_path = directory / f"{name}.safetensors"
    if framework == "np":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(a) for k, a in arrays.items()}, str(tensors_path))
    else:
        from safetensors.torch import save_file

        save_file(_torch_tensors(arrays), str(tensors_path))
    doc = {"schema": SCHEMA, "version": VERSION, "framework": framework, "meta": meta or {}, "tree": tree}
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps(doc, allow_nan=False))
    return [json_path, tensors_path]


def _torch_tensors(arrays: dict[str, Any]) -> dict[str, Any]:
    """Contiguous CPU tensors, numpy arrays converted, and a private copy of any storage reached twice
    (tied weights share one; safetensors refuses shared storage)."""
    torch = _torch()
    out, storages = {}, set()
    for k, a in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages and t.numel():
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def read_doc(directory: str | Path, name: str) -> dict:
    """The JSON document of a state file, schema and version checked."""
    path = Path(directory) / f"{name}.json"
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise StateFormatError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or "tree" not in doc:
        raise StateFormatError(f"{path} is not an {SCHEMA} file")
    if doc.get("version") != VERSION:
        raise StateFormatError(f"{path} is {SCHEMA} version {doc.get('version')!r}; this code reads version {VERSION}")
    return doc


def load(directory: str | Path, name: str, fetch: Fetch | None = None) -> Any:
    """Rebuild what `save` wrote. numpy-only files load without importing torch."""
    directory = Path(directory)
    doc = read_doc(directory, name)
    tensors_path = str(directory / f"{name}.safetensors")
    from safetensors import SafetensorError, safe_open

    with safe_open(tensors_path, framework=doc["framework"]) as f:
        def default_fetch(tag: dict) -> Any:
            if "$nd" in tag:
                a = f.get_tensor(tag["$nd"])
                return a.numpy() if doc["framework"] == "pt" else a
            if "$pt" in tag:
                return f.get_tensor(tag["$pt"])
            if fetch is not None:
                return fetch(tag)
            raise StateFormatError(f"unknown tag {sorted(tag)}")

        try:
            return decode(doc["tree"], default_fetch)
        except StateFormatError as e:
            raise StateFormatError(f"{directory / name}.json: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, SafetensorError) as e:  # a tag of the wrong shape
            raise StateFormatError(f"{directory / name}.json: not a state this code wrote ({type(e).__name__}: {e})") from None
