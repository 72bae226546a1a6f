"""The run directory: where it is (always absolute), whether it may be used, and getting it ready.

A run directory is *used* once a run in it finished a step: metrics.jsonl has a
row, or checkpoints/ holds a checkpoint, or an HF export exists. A directory
that does not exist, is empty, or holds only what a run leaves when it fails
before its first step (config.yaml, an empty metrics.jsonl, W&B start-up files)
is free. Files that no run writes make a directory count as used too, so a
mistyped run.dir never writes into someone's data. A used directory is never
silently reused: `train` refuses it, touching nothing, unless `run.resume` (go
on from its checkpoint) or `run.overwrite=true` (move the old contents aside
to `<dir>.old-<UTC time>`, then start fresh) says what to do. `run.overwrite`
only ever moves a run directory: one holding anything no run writes (a home
directory, a checkout) is refused, nothing moved.

While a run uses the directory it holds `run.lock` in it (async_april/run/lock.py):
a second run on the same directory, started at the same moment or later, exits 2
naming the first; `train` takes the lock, then looks at the directory again
(the other run may have finished a step meanwhile), then prepares it.

Under `ray job submit` the driver's working directory is Ray's temporary copy
of the job's working_dir (`<ray temp>/session_*/runtime_resources/
working_dir_files/...`), deleted with the session, so a relative run.dir is an
error there: Ray sets RAY_JOB_CONFIG_JSON_ENV_VAR for a job's driver
(ray/dashboard/modules/job/job_supervisor.py, `_get_driver_env_vars`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from async_april.config import Config
from async_april.run.console import plural, say
from async_april.errors import RunDirError
from async_april.run.lock import LOCK_FILE, RunLock

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray 2.x's job supervisor in the environment of every `ray job submit` driver."""
RUN_ENTRIES = frozenset({"config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "checkpoints", "wandb", "wandb_run_id",
                         "weights", "hf", "metrics.png", "placement.json", "placement.json.tmp", LOCK_FILE})
"""What a run writes into its directory (weights/: the disk weight transport; metrics.png: `async-april plot`;
placement.json: where its actors ran, async_april/hosts/placement.py; run.lock: the lock of the run using it)."""
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", LOCK_FILE)
"""One of these makes a directory a run directory (what run.overwrite may move aside)."""


@dataclass
class RunDirState:
    path: Path
    used: list[str] = field(default_factory=list)
    """Why the directory counts as used (empty: free)."""


def in_ray_job() -> bool:
    return RAY_JOB_ENV in os.environ


def absolute_run_dir(cfg: Config) -> Path:
    """`run.dir` as an absolute path; relative under `ray job submit` is a RunDirError."""
    path = cfg.run_dir
    if not path.is_absolute():
        if in_ray_job():
            raise RunDirError(
                f"run.dir={cfg.run.dir!r} is relative, and under `ray job submit` it would land in Ray's temporary "
                f"copy of the working directory ({os.getcwd()}), which Ray deletes with the session; set run.dir "
                "to an absolute path on storage every node sees, e.g. run.dir=/shared/runs/${name}")
        path = Path.cwd() / path
    return Path(os.path.normpath(path))


def inspect_run_dir(path: Path) -> RunDirState:
    """Whether `path` can hold a run, and whether one already used it. Reads only."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run.dir {path} is a file, not a directory; set run.dir to a directory path")
    parent = path
    while not parent.exists():
        parent = parent.parent
    try:  # a real probe: permission bits say nothing for root, nor for read-only or virtual filesystems
        os.rmdir(tempfile.mkdtemp(prefix=".async-april-probe-", dir=parent))
    except OSError as e:
        raise RunDirError(f"run.dir {path} is not writable ({parent}: {e.strerror}); "
                          "set run.dir to a directory you can write") from None
    state = RunDirState(path)
    if not path.is_dir():
        return state
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and (rows := sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())):
        state.used.append(f"metrics.jsonl has {plural(rows, 'row')}")
    ckpts = sorted(p.name for p in (path / "checkpoints").glob("step_*")) if (path / "checkpoints").is_dir() else []
    if ckpts:
        state.used.append(f"checkpoints {ckpts[0]}..{ckpts[-1]}" if len(ckpts) > 1 else f"checkpoint {ckpts[0]}")
    if (path / "hf").exists():
        state.used.append("an hf/ export")
    foreign = sorted(p.name for p in path.iterdir() if p.name not in RUN_ENTRIES)
    if foreign:
        state.used.append(f"files no run writes: {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}")
    return state


def check_reuse(state: RunDirState, cfg: Config) -> None:
    """RunDirError when a used directory would be reused without run.resume or run.overwrite, or replaced
    by run.overwrite though it is no run directory."""
    check_overwrite(state, cfg)
    if state.used and cfg.run.resume is None and not cfg.run.overwrite:
        what = "is not empty" if all(u.startswith("files no run") for u in state.used) else "already holds a run"
        raise RunDirError(
            f"run.dir {state.path} {what} ({'; '.join(state.used)}); nothing was changed. Continue it "
            "with run.resume=auto, start another with a new run.name (or run.dir), or replace it with "
            "run.overwrite=true (its contents move to <run.dir>.old-<time>)")


def check_overwrite(state: RunDirState, cfg: Config) -> None:
    """RunDirError when run.overwrite=true would move a directory that is not a run directory."""
    if not (state.used and cfg.run.overwrite):
        return
    foreign = sorted(p.name for p in state.path.iterdir() if p.name not in RUN_ENTRIES)
    if foreign or not any((state.path / m).exists() for m in RUN_MARKERS):
        what = f"it holds files no run writes: {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}" if foreign \
            else "it holds none of config.yaml, metrics.jsonl, checkpoints/"
        raise RunDirError(f"run.overwrite=true only replaces a run directory, and run.dir {state.path} is not one ({what}); "
                          "nothing was moved. Give run.dir a new directory, or move those files yourself")


def lock(state: RunDirState, cfg: Config) -> tuple[RunLock, RunDirState]:
    """Take the run directory's lock (RunDirError if another run holds it), then look at the directory
    again under the lock, as `check_reuse` did before it: returns the lock (release it when the run
    ends) and the directory's state now."""
    if state.path.exists() and not state.path.is_dir():
        raise RunDirError(f"run.dir {state.path} is a file, not a directory; set run.dir to a directory path")
    held = RunLock(state.path).acquire()
    try:
        now = inspect_run_dir(state.path)
        if now.used and not state.used:  # another run finished a step between resolve and the lock
            check_reuse(now, cfg)
        check_overwrite(now, cfg)
    except BaseException:
        held.release()
        raise
    if (note := held.stale_note()) is not None:
        say(note)
    return held, now


def prepare(state: RunDirState, cfg: Config) -> Path | None:
    """Make the locked directory ready for `train`: with run.overwrite, move a used run's contents
    (all but the lock, which this run holds) into `<run.dir>.old-<UTC time>` first (returns it)."""
    moved = None
    if state.used and cfg.run.overwrite:
        check_overwrite(state, cfg)
        moved = state.path.with_name(f"{state.path.name}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        moved.mkdir()
        for entry in sorted(state.path.iterdir()):
            if entry.name != LOCK_FILE:
                shutil.move(str(entry), str(moved / entry.name))
    try:
        state.path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run.dir {state.path} cannot be created ({e.strerror}); set run.dir to a writable location") from None
    return moved

