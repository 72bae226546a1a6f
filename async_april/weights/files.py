"""Open a model directory's files the way the engines will, without loading a tensor.

`check` and `train` must refuse a model the engines cannot load before any actor
starts (the torch engine and the learner call `AutoModelForCausalLM.from_pretrained`,
SGLang its own loader on the same files). What they need, checked here cheaply
enough for a 70B model (headers only):

  config.json       a JSON object (transformers: `PretrainedConfig.get_config_dict`)
                    whose `model_type` is a non-empty string (`AutoConfig` picks the
                    model class by it; null builds an empty config with only a warning)
  weights           model.safetensors, or model.safetensors.index.json whose
                    `weight_map` names shard files that exist (transformers
                    `modeling_utils._get_resolved_checkpoint_files`), or
                    pytorch_model.bin (its pickle is not opened here)
  each .safetensors a readable header: 8-byte little-endian length N, then N bytes of
                    JSON mapping each tensor to `dtype`, `shape`, `data_offsets`
                    inside the file (the format: huggingface/safetensors README,
                    "Format"; `safe_open` refuses the same files)

`safetensors_header` is also what checkpoint verification uses, whatever
`checkpoint.verify` says, so a shard with a corrupt header is a bad checkpoint
(skipped for the previous one), not a crash in the learner.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from async_april.errors import ModelError
from async_april.structured import loads_json

MAX_HEADER_BYTES = 100_000_000
"""safetensors refuses headers over 100 MB (`MAX_HEADER_SIZE` in safetensors/src/tensor.rs)."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class HeaderError(ValueError):
    """A .safetensors file whose header cannot be read."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The parsed header of safetensors file `path` (tensor name -> dtype, shape, data_offsets), or HeaderError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path.name}: {size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise HeaderError(f"{path.name}: header length {n} does not fit the file's {size} bytes (corrupt)")
        raw = f.read(n)
    try:
        header = loads_json(raw)
    except ValueError as e:
        raise HeaderError(f"{path.name}: header is not JSON ({str(e)[:80]}) (corrupt)") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path.name}: header is a {type(header).__name__}, not a JSON object (corrupt)")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise HeaderError(f"{path.name}: tensor {str(name)[:60]!r} lies outside the file's {data} data bytes (corrupt)")
    return header


def check_model_dir(model_dir: Path, spec: str) -> dict[str, Any]:
    """config.json of `model_dir` as a dict, after the checks above; ModelError naming `spec` (model.path) otherwise."""
    where = f"model.path {spec!r}"
    try:
        cfg = loads_json((model_dir / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise ModelError(f"{where}: {model_dir}/config.json is not readable JSON ({str(e)[:120]}); "
                         "give a Hugging Face model directory") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: {model_dir}/config.json holds a {type(cfg).__name__}, not a JSON object; "
                         "give a Hugging Face model directory")
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    model_type = cfg.get("model_type") or inner.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"{where}: {model_dir}/config.json has model_type {cfg.get('model_type')!r}; transformers "
                         "picks the model class by it: set it (e.g. \"qwen2\") or give another model directory")
    present = [f for f in WEIGHT_FILES if (model_dir / f).is_file()]
    if not present:
        raise ModelError(f"{where}: {model_dir} has no weights (none of {', '.join(WEIGHT_FILES)}); "
                         "copy the model's weight files there or give another model directory")
    shards: list[Path] = []
    if "model.safetensors" in present:
        shards = [model_dir / "model.safetensors"]
    elif "model.safetensors.index.json" in present:
        try:
            index = loads_json((model_dir / "model.safetensors.index.json").read_bytes())
            names = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{where}: {model_dir}/model.safetensors.index.json has no readable weight_map; "
                             "re-download the model") from None
        # Names, not paths: an index must not send us elsewhere (the hub cache's shards are symlinks into
        # its blobs/, so where a shard resolves to says nothing).
        shards = [model_dir / n for n in names if isinstance(n, str) and n and Path(n).name == n and n not in (".", "..")]
        if len(shards) != len(names):
            raise ModelError(f"{where}: model.safetensors.index.json names a shard that is not a file name in the "
                             "model directory; re-download the model")
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelError(f"{where}: shard {missing[0]} named by model.safetensors.index.json is missing"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; re-download the model")
    for shard in shards:
        try:
            safetensors_header(shard)
        except (OSError, HeaderError) as e:
            raise ModelError(f"{where}: {e}; re-download or re-export the model") from None
    return cfg


