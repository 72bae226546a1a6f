"""`model.path` as a Hugging Face hub ID (`org/name` or `org/name@revision`), resolved through the hub cache.

    resolve_hub_model("Qwen/Qwen3-4B@main") -> $HF_HUB_CACHE/models--Qwen--Qwen3-4B/snapshots/<commit>/

Online, missing files are downloaded into the cache (huggingface_hub.snapshot_download). Offline
(HF_HUB_OFFLINE=1) only the cache is read; a model not cached is a ModelError naming the ID and the
command that fetches it. `check` and `train` resolve on the driver (resolve.py), which pins the ID to the
commit its snapshot holds; every actor and learner rank then loads exactly that commit on its own node
(`snapshot_on_this_node`, from `model_path_on_this_node`), since a cluster's nodes have caches of their own,
and the storage probe (launch/node_checks.py) asks every node for it before anything starts there.

The cache layout (huggingface_hub 2.4.0, file_download.py `repo_folder_name` and `try_to_load_from_cache`):
    <cache>/models--org--name/refs/<branch or tag>    holds the commit hash the revision pointed to
    <cache>/models--org--name/snapshots/<commit>/     the files of that commit (symlinks into blobs/)
and <cache> is HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (constants.py, read here at call time).
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


COMMIT = re.compile(r"^[0-9a-f]{40}$")
"""A commit hash as huggingface_hub recognises one (file_download.py REGEX_COMMIT_HASH)."""


def hub_cache_dir() -> Path:
    """This process's Hugging Face hub cache, from the environment now (huggingface_hub's constants are
    read at its import, which in a Ray worker may predate a runtime_env's variables)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.path.expandvars(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def pinned_commit(snapshot: str | os.PathLike) -> str | None:
    """The commit a resolved snapshot directory (`.../snapshots/<commit>`) holds, or None if it is not one."""
    p = Path(snapshot)
    return p.name if COMMIT.match(p.name) and p.parent.name == "snapshots" else None


def cached_snapshot(repo: str, commit: str, cache: Path | None = None) -> Path | None:
    """`repo` at `commit` in this node's cache (config.json present), read offline; None if it is not there."""
    snap = (cache or hub_cache_dir()) / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def missing_commit(where: str, repo: str, commit: str, cache: str | os.PathLike, may_download: bool) -> str:
    """The line for a node whose cache lacks the pinned commit (`may_download`: model.download_on_nodes is set,
    but this node is offline)."""
    fix = (f"run `{fetch_command(repo, commit)}` on it" +
           (" (HF_HUB_OFFLINE is set there, so model.download_on_nodes cannot fetch it)" if may_download
            else ", or set model.download_on_nodes=true to let a node with network download it"))
    return (f"{where} has no {repo} at commit {commit} (the one the driver resolved model.path to) in its Hugging Face "
            f"cache {cache}; {fix}")


def snapshot_on_this_node(repo: str, commit: str, may_download: bool, where: str) -> Path:
    """`repo` at exactly `commit` from this node's cache; downloaded only when `may_download`
    (model.download_on_nodes) and this node is online; else a ModelError naming `where`, ID, commit and the fix."""
    cache = hub_cache_dir()
    snap = cached_snapshot(repo, commit, cache)
    if snap is not None:
        return snap
    if may_download and not offline():
        return resolve_hub_model(f"{repo}@{commit}")
    raise ModelError(missing_commit(where, repo, commit, cache, may_download))


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
