"""`model.path` as a Hugging Face hub ID (`org/name` or `org/name@revision`), resolved through the hub cache.

    resolve_hub_model("Qwen/Qwen3-4B@main") -> $HF_HUB_CACHE/models--Qwen--Qwen3-4B/snapshots/<commit>/

Online, missing files are downloaded into the cache (huggingface_hub.snapshot_download). Offline
(HF_HUB_OFFLINE=1) only the cache is read; a model not cached is a ModelError naming the ID and the
command that fetches it. `check` and `train` resolve on the driver (resolve.py); every actor resolves
again on its own node (`model_path_on_this_node`), since a cluster's nodes have caches of their own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from async_april.errors import ModelError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
"""`org/name[@revision]`: the hub's repo-id characters, one slash."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    m = HUB_ID.match(spec)
    return (m["repo"], m["rev"]) if m else None


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but at call time (its constant is read at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in ("1", "ON", "YES", "TRUE")


def fetch_command(repo: str, rev: str | None) -> str:
    return f"hf download {repo}" + (f" --revision {rev}" if rev else "")


def resolve_hub_model(spec: str) -> Path:
    """The local snapshot directory of hub ID `spec` (downloaded first when online)."""
    from huggingface_hub import snapshot_download

    parsed = parse_hub_id(spec)
    if parsed is None:
        raise ModelError(f"model.path {spec!r} is not a hub ID (org/name or org/name@revision)")
    repo, rev = parsed
    is_offline = offline()
    try:
        path = snapshot_download(repo, revision=rev, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 local_files_only=is_offline)
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many kinds; all mean "not available"
        if is_offline:
            raise ModelError(f"model.path {spec!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; fetch it "
                             f"on a machine with network access: `{fetch_command(repo, rev)}` (or unset HF_HUB_OFFLINE)") from None
        raise ModelError(f"model.path {spec!r}: neither a local directory nor a model the hub gave us "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the ID, or fetch it "
                         f"with `{fetch_command(repo, rev)}`") from None
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"model.path {spec!r}: the cached snapshot {path} has no config.json; "
                         f"fetch it again with `{fetch_command(repo, rev)}`")
    return path
