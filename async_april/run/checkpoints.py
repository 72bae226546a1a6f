"""Run-level checkpoints: learner + rollout store + controller state, atomic, verified, rotated, pickle-free.

Layout (one directory per checkpoint, under `run.dir/checkpoints/`):

    step_00000012/
      learner/          learners/checkpoint.py: per-rank safetensors shards + JSON index
      store.json        RolloutStore.state_dict() as plain data (async_april/run/state_codec.py):
      store.safetensors prompt cursor, open groups, partial buffer (tokens, logprobs, versions
                        as arrays), completed groups, trained/filtered lists, counters
      controller.json   step, policy version, elapsed time, cumulative controller counters
      manifest.json     written LAST: schema FORMAT, step, version, W&B run id, config hash,
                        the model's shape, and every other file with its size and sha256

Nothing in a checkpoint is a pickle: loading one runs no code. A checkpoint is
written under `.tmp-step_XXXXXXXX`, every file and directory in it is fsynced,
and only then is it renamed into place (and the parent directory fsynced), so a
crash or power loss never leaves a half checkpoint under a final name. Loading
validates the manifest against its schema (`Manifest`) and the files against it
(sizes, and sha256 unless `checkpoint.verify: size`); a checkpoint that fails is
skipped with a warning naming it and the one used instead. Older checkpoints
beyond `checkpoint.keep` are deleted after each successful save (never the one
just written). The checkpoint a run resumes from is then read back before
anything is written (`async_april/launch/resolve.py`): its store state must decode
(`state_codec`: allowed classes, their own fields, well-formed tags) into a store
of this config whose accounting holds, and controller.json must hold the counts a
resume reads; anything else is one CheckpointError naming the file, not a
traceback after Ray started.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from async_april.run import state_codec
from async_april.config import Config, ConfigError
from async_april.errors import UserError, one_line, short_repr
from async_april.structured import loads_json
from async_april.weights.files import safetensors_header

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT = 2
"""Manifest format. 1 held a pickled store (`store.pkl`) and is no longer loaded."""
REQUIRED_FILES = ("store.json", "store.safetensors", "controller.json", "learner/learner.json")
MODEL_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
"""config.json entries that decide whether a checkpoint's tensors fit a model."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or for another model."""


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    bytes: int = Field(ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """What `manifest.json` must hold; anything else makes the checkpoint invalid."""

    model_config = ConfigDict(extra="forbid", strict=True)
    format: int
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    wandb_run_id: str | None
    config_hash: str
    model_shape: dict[str, Any]
    created_unix: float | int
    files: dict[str, FileEntry] = Field(min_length=1)


RESTORED_KEYS = ("step", "policy_version", "train/bad_steps", "rollout/actor_restarts")
"""controller.json entries a resume reads as counts (launch/controller.py RunState.restore): integers >= 0."""
NOT_WRITTEN_BY_US = ("async-april never writes that (the checkpoint was edited, or is not from this version); resume "
                     "from another checkpoint (run.resume=PATH) or start afresh (a new run.dir, or run.overwrite=true)")


@dataclass
class Checkpoint:
    path: Path
    manifest: Manifest
    _store: dict | None = field(default=None, repr=False, compare=False)

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def version(self) -> int:
        return self.manifest.policy_version

    @property
    def learner_dir(self) -> Path:
        return self.path / "learner"

    def store_state(self) -> dict:
        """The store's state, decoded once (then reused); CheckpointError naming store.json and what is wrong
        when state_codec cannot read it back (a class it does not allow, fields a class lacks, a malformed tag)."""
        if self._store is None:
            try:
                state = state_codec.load(self.path, "store")
            except (state_codec.StateFormatError, OSError) as e:
                raise CheckpointError(f"run.resume: {one_line(str(e), 300)}; {NOT_WRITTEN_BY_US}") from None
            if not isinstance(state, dict):
                raise CheckpointError(f"run.resume: {self.path / 'store.json'} holds a {type(state).__name__}, "
                                      f"not the store's state; {NOT_WRITTEN_BY_US}")
            self._store = state
        return self._store

    def controller_state(self) -> dict[str, Any]:
        return json.loads((self.path / "controller.json").read_text())

    def check_controller_state(self) -> None:
        """CheckpointError unless controller.json is an object with the counts a resume reads (RESTORED_KEYS)."""
        path = self.path / "controller.json"
        try:
            c = loads_json(path.read_bytes())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"run.resume: {path} is unreadable ({one_line(str(e), 200)})") from None
        bad = [k for k in RESTORED_KEYS if not isinstance(c, dict) or type(c.get(k)) is not int or c[k] < 0]
        if bad:
            raise CheckpointError(f"run.resume: {path} lacks integer counts >= 0 for {', '.join(bad)}; {NOT_WRITTEN_BY_US}")


def config_hash(cfg: Config) -> str:
    """Hash of the settings that shape training; run.* bookkeeping, logging and eval may change across a resume."""
    data = cfg.to_yaml_dict()
    for key in ("steps", "resume", "dir", "name", "ray_address", "overwrite"):
        data["run"].pop(key, None)
    data.pop("logging", None)
    data.pop("eval", None)  # evaluation never changes training
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_shape(model: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The entries of a model's config.json (a model directory, or its config already read) that decide
    whether saved tensors fit (MODEL_SHAPE_KEYS)."""
    cfg = model if isinstance(model, dict) else loads_json((Path(model) / "config.json").read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{model}/config.json holds a {type(cfg).__name__}, not a JSON object")
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict) else cfg
    return {k: cfg.get(k) for k in MODEL_SHAPE_KEYS}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root`): their data and names are on disk."""
    for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)) + [root]:
        _fsync(p)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Writes, verifies, finds and rotates run checkpoints under `run_dir/checkpoints`."""

    def __init__(self, run_dir: Path, keep: int = 2, verify: str = "sha256"):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.verify_mode = verify

    def path_for(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    # -- write ------------------------------------------------------------------
    def save(self, step: int, version: int, learner, store_state: dict, controller: dict[str, Any],
             wandb_run_id: str | None, cfg_hash: str, shape: dict[str, Any]) -> Path:
        """Write checkpoint `step` atomically, then rotate. `learner` has `save_checkpoint(path)`."""
        t0 = time.perf_counter()
        final = self.path_for(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        learner.save_checkpoint(str(tmp / "learner"))
        state_codec.save(store_state, tmp, "store")
        (tmp / "controller.json").write_text(json.dumps(controller, indent=1, sort_keys=True))
        files = {}
        for p in _files(tmp):
            entry: dict[str, Any] = {"bytes": p.stat().st_size}
            if self.verify_mode == "sha256":
                entry["sha256"] = _sha256(p)
            files[str(p.relative_to(tmp))] = entry
        manifest = Manifest(format=FORMAT, step=step, policy_version=version, wandb_run_id=wandb_run_id,
                            config_hash=cfg_hash, model_shape=shape, created_unix=time.time(), files=files)
        (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=1))
        fsync_tree(tmp)
        if final.exists():  # a resumed run re-reaching a step it had saved before the crash
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(self.root)  # the rename itself is durable
        self.rotate(keep_path=final)
        log.info("checkpoint %s written in %.2fs", final, time.perf_counter() - t0)
        return final

    def rotate(self, keep_path: Path | None = None) -> None:
        """Delete the oldest checkpoints beyond `keep` (and leftover temporary directories)."""
        for tmp in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)
        ckpts = self.list()
        for old in ckpts[: max(0, len(ckpts) - self.keep)]:
            if old != keep_path:
                shutil.rmtree(old, ignore_errors=True)

    # -- read ---------------------------------------------------------------------
    def list(self) -> list[Path]:
        """Checkpoint directories, oldest first (by step in the name)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), key=lambda p: p.name)

    def verify(self, path: Path) -> Checkpoint:
        """The checkpoint at `path`, or CheckpointError saying what is wrong with it. Whatever
        `checkpoint.verify` says, every file is also opened as its loader will open it (JSON parsed,
        safetensors headers read: cheap), so no checkpoint that passes fails later on load."""
        path = Path(path)
        manifest = read_manifest(path)
        try:
            for rel, want in manifest.files.items():
                p = path / rel
                if not p.is_file():
                    raise CheckpointError(f"{path}: {rel} is missing")
                size = p.stat().st_size
                if size != want.bytes:
                    raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says {want.bytes} (truncated?)")
                if self.verify_mode == "sha256" and want.sha256 and _sha256(p) != want.sha256:
                    raise CheckpointError(f"{path}: {rel} does not match its sha256 in the manifest (corrupt)")
                _open_like_the_loader(p)
        except (OSError, ValueError) as e:  # unreadable (permissions, I/O error) or not what its loader reads
            raise CheckpointError(f"{path}: {rel} is unreadable ({one_line(str(e), 200)})") from None
        return Checkpoint(path, manifest)

    def latest_valid(self, below: Path | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies (older than `below` if given), warning about each that does not."""
        bad: list[str] = []
        for p in reversed(self.list()):
            if below is not None and p.name >= Path(below).name:
                continue
            try:
                ck = self.verify(p)
            except CheckpointError as e:
                bad.append(str(e))
                continue
            if bad:
                log.warning("skipping invalid checkpoint(s): %s; using %s instead", "; ".join(bad), p)
            return ck
        if bad:
            log.warning("no valid checkpoint in %s: %s", self.root, "; ".join(bad))
        return None


def _open_like_the_loader(p: Path) -> None:
    """ValueError unless `p` parses as its loader will parse it: JSON, or a safetensors header."""
    if p.suffix == ".json":
        loads_json(p.read_bytes())
    elif p.suffix == ".safetensors":
        safetensors_header(p)


def _confined(path: Path, rel: str) -> str | None:
    """Why manifest entry `rel` is not a plain file path inside checkpoint `path`, or None. Decided from
    the names alone and lstat of the entries inside the checkpoint: the named file is never opened."""
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or "\\" in rel or "\x00" in rel:
        return "is not a relative path inside the checkpoint"
    inner = path
    for part in parts:
        inner = inner / part
        if inner.is_symlink():
            return "goes through a symbolic link"
    return None


def read_manifest(path: Path) -> Manifest:
    """The schema-checked manifest of the checkpoint at `path`, or CheckpointError naming what is wrong."""
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
    try:
        data = loads_json(mf.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({one_line(str(e), 200)})") from None
    if isinstance(data, dict) and data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MANIFEST} has format {data.get('format')!r}, this code reads format {FORMAT}"
                              + (" (format 1 held a pickle and is no longer loaded)" if data.get("format") == 1 else ""))
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        what = "; ".join(f"{'.'.join(map(str, err['loc']))[:80] or '<root>'}: {err['msg']}" for err in e.errors()[:5])
        raise CheckpointError(f"{path}: {MANIFEST} does not match its schema ({what})") from None
    for rel in manifest.files:  # a manifest naming ../../etc/shadow would make verify a size/sha256 oracle
        if (why := _confined(path, rel)) is not None:
            raise CheckpointError(f"{path}: {MANIFEST} names {short_repr(rel, 80)}, which {why}; refused without "
                                  "reading it (this checkpoint was not written by async-april, or was tampered with)")
    missing = [f for f in REQUIRED_FILES if f not in manifest.files]
    if missing:
        raise CheckpointError(f"{path}: {MANIFEST} does not list {', '.join(missing)} (incomplete checkpoint)")
    return manifest


def resolve_resume(cfg: Config, run_dir: Path | None = None) -> Checkpoint | None:
    """The checkpoint `run.resume` names: None (fresh start), `auto` (latest valid in the run
    directory, or a fresh start if there is none) or a path (a checkpoint directory, a
    `checkpoints/` directory or a run directory). A named checkpoint that fails
    verification falls back to the newest valid one before it, with a warning naming both."""
    resume = cfg.run.resume
    if resume is None:
        return None
    verify = cfg.checkpoint.verify
    run_dir = run_dir or cfg.run_dir
    if resume == "auto":
        ck = CheckpointManager(run_dir, verify=verify).latest_valid()
        if ck is None:
            log.warning("run.resume=auto: no valid checkpoint in %s; starting from scratch", run_dir / "checkpoints")
        return ck
    path = Path(resume).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"run.resume={resume!r}: no such checkpoint; give a checkpoint directory, a run directory or `auto`")
    if path.name.startswith(PREFIX):
        mgr = CheckpointManager(path.parent.parent, verify=verify)
        try:
            return mgr.verify(path)
        except CheckpointError as e:
            ck = mgr.latest_valid(below=path)
            if ck is None:
                raise CheckpointError(f"run.resume={resume!r}: {one_line(str(e))}; and no older valid checkpoint next to it") from None
            log.warning("%s; using the previous valid checkpoint %s instead", e, ck.path)
            return ck
    resume_dir = path.parent if path.name == "checkpoints" else path
    ck = CheckpointManager(resume_dir, verify=verify).latest_valid()
    if ck is None:
        raise CheckpointError(f"run.resume={resume!r}: no valid checkpoint under {resume_dir / 'checkpoints'}; "
                              "give a directory that holds checkpoints/step_*, or run.resume=auto to start fresh when there is none")
    return ck


def check_model_fits(ck: Checkpoint, shape: dict[str, Any]) -> None:
    """CheckpointError when `ck` was saved for a model of another shape than `shape` (model.path)."""
    saved = ck.manifest.model_shape
    diff = {k: (saved.get(k), shape.get(k)) for k in MODEL_SHAPE_KEYS if saved.get(k) != shape.get(k)}
    if diff:
        what = ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"run.resume: {ck.path} was saved for another model than model.path ({what}; "
                              "checkpoint vs model); resume with the model it was trained from")
