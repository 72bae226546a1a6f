"""Run-level checkpoints: learner + rollout store + controller state, atomic, verified, rotated.

Layout (one directory per checkpoint, under `run.dir/checkpoints/`):

    step_00000012/
      learner/          learners/checkpoint.py (DCP shards, per-rank scheduler/RNG, learner.json)
      store.pkl         pickle of RolloutStore.state_dict(): prompt cursor, open groups, partial
                        buffer (tokens, logprobs, versions), completed groups, trained/filtered lists
      controller.json   step, policy version, cumulative controller counters
      manifest.json     written LAST: step, version, W&B run id, config hash, and every other
                        file with its size and sha256

A checkpoint is written under `.tmp-step_XXXXXXXX` and renamed into place only
once complete, so a crash never leaves a half checkpoint under a final name.
Loading verifies the manifest (sizes, and sha256 unless `checkpoint.verify:
size`); a checkpoint that fails is skipped with a warning naming it and the
one used instead. Older checkpoints beyond `checkpoint.keep` are deleted after
each successful save (never the one just written).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_april.config import Config

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


@dataclass
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def version(self) -> int:
        return int(self.manifest["policy_version"])

    @property
    def learner_dir(self) -> Path:
        return self.path / "learner"

    def store_state(self) -> dict:
        with open(self.path / "store.pkl", "rb") as f:
            return pickle.load(f)

    def controller_state(self) -> dict[str, Any]:
        return json.loads((self.path / "controller.json").read_text())


def config_hash(cfg: Config) -> str:
    """Hash of the settings that shape training; run.steps/resume/dir/name may change across a resume."""
    data = cfg.to_yaml_dict()
    for key in ("steps", "resume", "dir", "name", "ray_address"):
        data["run"].pop(key, None)
    data.pop("logging", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


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
             wandb_run_id: str | None, cfg_hash: str) -> Path:
        """Write checkpoint `step` atomically, then rotate. `learner` has `save_checkpoint(path)`."""
        t0 = time.perf_counter()
        final = self.path_for(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        learner.save_checkpoint(str(tmp / "learner"))
        with open(tmp / "store.pkl", "wb") as f:
            pickle.dump(store_state, f, protocol=pickle.HIGHEST_PROTOCOL)
        (tmp / "controller.json").write_text(json.dumps(controller, indent=1, sort_keys=True))
        files = {}
        for p in _files(tmp):
            entry: dict[str, Any] = {"bytes": p.stat().st_size}
            if self.verify_mode == "sha256":
                entry["sha256"] = _sha256(p)
            files[str(p.relative_to(tmp))] = entry
        manifest = {"format": FORMAT, "step": step, "policy_version": version, "wandb_run_id": wandb_run_id,
                    "config_hash": cfg_hash, "created_unix": time.time(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if final.exists():  # a resumed run re-reaching a step it had saved before the crash
            shutil.rmtree(final)
        tmp.rename(final)
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
        """The checkpoint at `path`, or CheckpointError saying what is wrong with it."""
        path = Path(path)
        mf = path / MANIFEST
        if not mf.is_file():
            raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
        try:
            manifest = json.loads(mf.read_text())
        except ValueError as e:
            raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({e})") from None
        for rel, want in manifest.get("files", {}).items():
            p = path / rel
            if not p.is_file():
                raise CheckpointError(f"{path}: {rel} is missing")
            size = p.stat().st_size
            if size != want["bytes"]:
                raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
            if self.verify_mode == "sha256" and "sha256" in want and _sha256(p) != want["sha256"]:
                raise CheckpointError(f"{path}: {rel} does not match its sha256 in the manifest (corrupt)")
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


def resolve_resume(cfg: Config) -> Checkpoint | None:
    """The checkpoint `run.resume` names: None (fresh start), `auto` (latest valid in the run
    directory, or a fresh start if there is none) or a path (a checkpoint directory, a
    `checkpoints/` directory or a run directory). A named checkpoint that fails
    verification falls back to the newest valid one before it, with a warning naming both."""
    resume = cfg.run.resume
    if resume is None:
        return None
    verify = cfg.checkpoint.verify
    if resume == "auto":
        ck = CheckpointManager(cfg.run_dir, verify=verify).latest_valid()
        if ck is None:
            log.warning("run.resume=auto: no valid checkpoint in %s; starting from scratch", cfg.run_dir / "checkpoints")
        return ck
    path = Path(resume).expanduser()
    if not path.exists():
        from async_april.config import ConfigError

        raise ConfigError(f"run.resume={resume!r}: no such checkpoint; give a checkpoint directory, a run directory or `auto`")
    if path.name.startswith(PREFIX):
        mgr = CheckpointManager(path.parent.parent, verify=verify)
        try:
            return mgr.verify(path)
        except CheckpointError as e:
            ck = mgr.latest_valid(below=path)
            if ck is None:
                raise CheckpointError(f"{e}; and no older valid checkpoint next to it") from None
            log.warning("%s; using the previous valid checkpoint %s instead", e, ck.path)
            return ck
    run_dir = path.parent if path.name == "checkpoints" else path
    ck = CheckpointManager(run_dir, verify=verify).latest_valid()
    if ck is None:
        raise CheckpointError(f"run.resume={resume!r}: no valid checkpoint under {run_dir / 'checkpoints'}")
    return ck
