"""Metrics sinks: metrics.jsonl (always), Weights & Biases (online/offline/disabled), console.

One step axis (`train/step`) for everything. Keys are namespaced (`train/`,
`rollout/`, `reward/`, `staleness/`, `is/`, `loss/`, `perf/`, `timing_s/`,
`data/`, `time/`). A key ending `_hist` holds counts per integer lag (a list in
metrics.jsonl) and goes to W&B as a histogram. On a resume from the checkpoint of step k, rows past k (the
steps a crash lost) are dropped from metrics.jsonl before anything is appended,
so the file holds one row per step; `time/elapsed_s` continues from the
checkpoint; and the W&B run of this run directory is rewound to step k
(`resume_from`; see `_init_wandb`). If the crash tore the row of step k itself
(the checkpoint's own step), that row is put back from the copy the checkpoint
holds (`controller.json`, `metrics_row`), so the file still has one row per
step; a row whose `train/step` is not an integer is dropped and counted, and
the message says which of these happened.

Durability: every row is fsynced as it is written, so a checkpoint (fsynced
after it) never exists for a step whose row is not on disk.

Secrets (WANDB_API_KEY and friends) are read from the environment by wandb
itself and never pass through here; as a second guard, any string logged here,
and the config handed to W&B, have secrets masked (async_april/run/masking.py).
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
from async_april.run.console import TrainingProgress, run_summary, say
from async_april.errors import UserError, one_line
from async_april.run.masking import mask_config, redact, secret_values
from async_april.structured import loads_json


class TrackingError(UserError, RuntimeError):
    """Weights & Biases cannot be used as logging.wandb asks (no key, no network)."""

log = logging.getLogger(__name__)

progress = say
"""One `[async-april] ...` line on stderr (kept under this name for scripts that import it from here)."""

WANDB_INIT_TIMEOUT_S = 60.0
"""How long `wandb.init` may take to reach its server (wandb's own default is 90 s, then a traceback)."""


def check_wandb_key(cfg: Config) -> None:
    """TrackingError when logging.wandb=online finds no API key where wandb looks (WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, the ~/.netrc entry `wandb login` writes: wandb/sdk/lib/wbauth/authenticate.py
    `_use_system_auth`); wandb would otherwise prompt or raise after Ray and the actors started."""
    import netrc
    import os
    from urllib.parse import urlparse

    if cfg.logging.wandb != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise TrackingError(f"logging.wandb=online needs a W&B API key for {host}: set WANDB_API_KEY or run `wandb login`, "
                        "or set logging.wandb=offline (upload later with `wandb sync`)")


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_rows(path: Path) -> tuple[list[dict], int]:
    """(rows, lines skipped) of a metrics.jsonl; a line that is not a JSON object (torn by a kill, or
    nested too deep to read) is skipped."""
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        if not line.strip():
            continue
        try:
            row = loads_json(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def row_step(row: dict) -> int | None:
    """The row's `train/step` if it is an integer (JSON 3 or 3.0), else None."""
    s = row.get("train/step")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s != int(s):
        return None
    return int(s)


def truncate_metrics(path: Path, step: int, checkpoint_row: dict | None = None) -> list[str]:
    """Keep one row per step up to `step` (the last written wins) and drop the rest, atomically; the
    row of `step` itself, if missing (torn by the crash), comes back from `checkpoint_row` (the copy the
    checkpoint holds). Returns what was done, one phrase each (empty: the file was already exact)."""
    rows, bad = read_rows(path)
    by_step: dict[int, dict] = {}
    past = not_integer = 0
    for r in rows:
        s = row_step(r)
        if s is None:
            not_integer += 1
        elif s > step:
            past += 1
        else:
            by_step[s] = r
    duplicates = len(rows) - not_integer - past - len(by_step)
    done = []
    if past:
        done.append(f"dropped {past} row(s) past step {step} (those steps are redone now)")
    if bad:
        done.append(f"dropped {bad} line(s) that are not JSON rows (cut short by the crash)")
    if not_integer:
        done.append(f"dropped {not_integer} row(s) whose train/step is not an integer")
    if duplicates:
        done.append(f"kept the last of {duplicates + len(by_step)} rows for {len(by_step)} steps")
    if step > 0 and step not in by_step:
        if checkpoint_row is not None and row_step(checkpoint_row) == step:
            by_step[step] = checkpoint_row
            done.append(f"restored the row of step {step} from its checkpoint (it was lost or torn in the file)")
        else:
            done.append(f"the row of step {step} is missing and its checkpoint holds no copy: that step stays "
                        "without a row")
    if path.is_file() and (past or bad or not_integer or duplicates or step in by_step and by_step[step] is checkpoint_row):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(by_step[s]) + "\n" for s in sorted(by_step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return done


def wandb_row(row: dict[str, Any]) -> dict[str, Any]:
    """What W&B gets of a row: the numbers, and each `*_hist` list of counts per integer lag
    (async_april/algorithms/metrics.py) as a histogram with one bin per lag, centred on it."""
    import numpy as np
    import wandb

    from async_april.algorithms.metrics import HISTOGRAM_SUFFIX

    out: dict[str, Any] = {k: v for k, v in row.items() if isinstance(v, (int, float))}
    for k, v in row.items():
        if k.endswith(HISTOGRAM_SUFFIX) and isinstance(v, list) and v:
            out[k] = wandb.Histogram(np_histogram=(np.asarray(v, np.float64), np.arange(len(v) + 1) - 0.5))
    return out


class Tracker:
    """`log(metrics)` once per step; `resume_step` (resuming from that checkpoint step, 0 when a resume
    found none) truncates metrics.jsonl past it and continues `time/elapsed_s` from `elapsed_s`."""

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None, elapsed_s: float = 0.0,
                 wandb_run_id: str | None = None, checkpoint_row: dict | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and (done := truncate_metrics(self.path, resume_step, checkpoint_row)):
            say(f"metrics.jsonl, resuming from step {resume_step}: " + "; ".join(done))
        self.last_row: dict | None = None
        """The last row written (the checkpoint of its step keeps a copy)."""
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
                      mode=self.cfg.logging.wandb, dir=str(self.run_dir), config=mask_config(self.cfg.to_yaml_dict()),
                      settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S))
        try:
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
        except (wandb.Error, OSError, TimeoutError) as e:  # no network, server refused the key, ...
            raise TrackingError(f"logging.wandb={self.cfg.logging.wandb}: W&B did not start ({type(e).__name__}: "
                                f"{one_line(str(e), 200)}); check the network and WANDB_API_KEY, or set "
                                "logging.wandb=offline (upload later with `wandb sync`)") from None
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
        os.fsync(self._file.fileno())  # on disk before the checkpoint of this step can be
        self.last_row = row
        if self._wandb is not None:
            self._wandb.log(wandb_row(row), step=int(row.get("train/step", 0)))
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
