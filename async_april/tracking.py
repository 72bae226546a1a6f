"""Metrics sinks: metrics.jsonl (always), Weights & Biases (online/offline/disabled), console.

One step axis (`train/step`) for everything. Keys are namespaced (`train/`,
`rollout/`, `reward/`, `staleness/`, `is/`, `loss/`, `perf/`, `timing_s/`,
`data/`, `time/`). On a resume from the checkpoint of step k, rows past k (the
steps a crash lost) are dropped from metrics.jsonl before anything is appended,
so the file holds one row per step; `time/elapsed_s` continues from the
checkpoint; and the W&B run of this run directory is rewound to step k
(`resume_from`; see `_init_wandb`). Secrets (WANDB_API_KEY and friends) are
read from the environment by wandb itself and never pass through here; as a
second guard, any string logged here that contains the value of an env var
ending in _API_KEY, _TOKEN, _SECRET or _PASSWORD is written with that value
replaced by `***`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from async_april.config import Config
from async_april.console import TrainingProgress, run_summary, say

log = logging.getLogger(__name__)

progress = say
"""One `[async-april] ...` line on stderr (kept under this name for scripts that import it from here)."""

SECRET_SUFFIXES = ("_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD")
"""Environment variables whose values are treated as secrets (WANDB_API_KEY, HF_TOKEN, ...)."""


def secret_values() -> list[str]:
    """Values of secret-looking environment variables (8+ characters, so short flags are not masked)."""
    return [v for k, v in os.environ.items() if k.upper().endswith(SECRET_SUFFIXES) and len(v) >= 8]


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret value from the environment replaced by `***`."""
    for v in secret_values() if secrets is None else secrets:
        text = text.replace(v, "***")
    return text


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_rows(path: Path) -> tuple[list[dict], int]:
    """(rows, lines skipped) of a metrics.jsonl; a line that is not a JSON object (torn by a kill) is skipped."""
    rows, bad = [], 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def truncate_metrics(path: Path, step: int) -> int:
    """Keep one row per step up to `step` (the last written wins) and drop the rest, atomically.
    Returns the number of lines dropped."""
    rows, bad = read_rows(path)
    by_step = {int(r.get("train/step", 0)): r for r in rows if int(r.get("train/step", 0)) <= step}
    dropped = bad + len(rows) - len(by_step)
    if path.is_file() and dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(by_step[s]) + "\n" for s in sorted(by_step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class Tracker:
    """`log(metrics)` once per step; `resume_step` (resuming from that checkpoint step, 0 when a resume
    found none) truncates metrics.jsonl past it and continues `time/elapsed_s` from `elapsed_s`."""

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None, elapsed_s: float = 0.0,
                 wandb_run_id: str | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and (dropped := truncate_metrics(self.path, resume_step)):
            say(f"dropped {dropped} metrics.jsonl row(s) past step {resume_step} (they are redone now)")
        self._file = self.path.open("a")
        self._t0 = time.time() - elapsed_s
        self._secrets = secret_values()
        self._wandb = None
        if cfg.logging.wandb != "disabled":
            self._wandb = self._init_wandb(wandb_run_id, resume_step)
        self.console = TrainingProgress(cfg.run.steps, resume_step or 0, cfg.logging.console_every)

    def _init_wandb(self, run_id: str | None, resume_step: int | None):
        """A new W&B run, or (resuming from step k of this run directory's W&B run) that run rewound
        to step k with `resume_from="<id>?_step=k"`: W&B keeps its history up to k and takes the
        steps logged from here on (each logged with `step=train/step`). Offline runs record the
        rewind point in their offline-run directory and it applies when `wandb sync` uploads them.
        A server that refuses rewinding gets the plain resume (`resume="allow"`), with a warning."""
        import wandb

        kwargs = dict(project=self.cfg.logging.project, entity=self.cfg.logging.entity, name=self.cfg.run.name,
                      mode=self.cfg.logging.wandb, dir=str(self.run_dir), config=self.cfg.to_yaml_dict())
        if run_id and resume_step is not None:
            try:
                run = wandb.init(**kwargs, resume_from=f"{run_id}?_step={resume_step}")
            except wandb.Error as e:
                log.warning("W&B could not rewind run %s to step %d (%s); resuming it instead: steps logged "
                            "after %d before the crash keep their old values there (metrics.jsonl is exact)",
                            run_id, resume_step, e, resume_step)
                run = wandb.init(**kwargs, id=run_id, resume="allow")
        else:
            run = wandb.init(**kwargs)
        (self.run_dir / "wandb_run_id").write_text(run.id)
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        return run

    def start(self) -> None:
        """The step loop begins: the console's ETA clock starts now."""
        self.console.start()

    def log(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write one step's row everywhere; returns it (with `time/elapsed_s`)."""
        row = {k: _jsonable(v) for k, v in metrics.items()}
        row = {k: redact(v, self._secrets) if isinstance(v, str) else v for k, v in row.items()}
        row["time/elapsed_s"] = round(self.elapsed_s, 3)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(row.get("train/step", 0)))
        self.console.step(row)
        return row

    @property
    def elapsed_s(self) -> float:
        """Wall time of the run, across resumes."""
        return time.time() - self._t0

    @property
    def wandb_run_id(self) -> str | None:
        return self._wandb.id if self._wandb is not None else None

    def summary(self, checkpoint: Path | None) -> str:
        return run_summary(read_rows(self.path)[0], self.run_dir, checkpoint)

    def close(self) -> None:
        self.console.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
