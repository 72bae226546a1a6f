"""Metrics sinks: metrics.jsonl (always), Weights & Biases (online/offline/disabled), console.

One step axis (`train/step`) for everything. Keys are namespaced (`rollout/`,
`staleness/`, `is/`, `loss/`, `perf/`, `timing_s/`, `train/`). The W&B run id
is kept in the run directory so a resumed run continues the same W&B run.
Secrets (WANDB_API_KEY and friends) are read from the environment by wandb
itself and never pass through here; as a second guard, any string logged
here that contains the value of an env var ending in _API_KEY, _TOKEN,
_SECRET or _PASSWORD is written with that value replaced by `***`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from async_april.config import Config

CONSOLE_KEYS = (
    ("train/step", "step {:>4.0f}"),
    ("rollout/reward_mean", "reward {:.3f}"),
    ("rollout/response_len_mean", "len {:.1f}"),
    ("loss/policy", "loss {:+.4f}"),
    ("staleness/max", "stale {:.0f}"),
    ("perf/rollout_tokens_per_s", "gen {:.0f} tok/s"),
    ("timing_s/rollout", "wait {:.2f}s"),
    ("timing_s/train", "train {:.2f}s"),
    ("timing_s/weight_sync", "sync {:.2f}s"),
)


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


class Tracker:
    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        self.cfg = cfg
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if resume else "w")
        self._t0 = time.time()
        self._secrets = secret_values()
        self._wandb = None
        if cfg.logging.wandb != "disabled":
            self._wandb = self._init_wandb(resume)

    def _init_wandb(self, resume: bool):
        import wandb

        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        run = wandb.init(
            project=self.cfg.logging.project,
            entity=self.cfg.logging.entity,
            name=self.cfg.run.name,
            mode=self.cfg.logging.wandb,
            dir=str(self.run_dir),
            config=self.cfg.to_yaml_dict(),
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_file.write_text(run.id)
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        return run

    def log(self, metrics: dict[str, Any]) -> None:
        row = {k: _jsonable(v) for k, v in metrics.items()}
        row = {k: redact(v, self._secrets) if isinstance(v, str) else v for k, v in row.items()}
        row["time/elapsed_s"] = round(time.time() - self._t0, 3)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))})
        step = int(row.get("train/step", 0))
        if step % self.cfg.logging.console_every == 0:
            print(console_line(row, self.cfg.run.steps), flush=True)

    @property
    def wandb_run_id(self) -> str | None:
        return self._wandb.id if self._wandb is not None else None

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def console_line(row: dict[str, Any], total_steps: int) -> str:
    parts = [fmt.format(row[k]) for k, fmt in CONSOLE_KEYS if isinstance(row.get(k), (int, float))]
    return f"[{row.get('train/step', 0):.0f}/{total_steps}] " + " | ".join(parts[1:])


def progress(msg: str) -> None:
    print(f"[async-april] {msg}", file=sys.stderr, flush=True)
