"""Shared pieces of the benchmark scripts: mode configs, runs, reward curves."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from async_april.config import Config, load_config  # noqa: E402

MODES = ("sync", "april", "async")
RESULTS = REPO / "benchmarks" / "results"


def mode_config(mode: str, tmp: Path, overrides: list[str], base: str = "configs/tiny_cpu.yaml") -> Config:
    """The tiny CPU config with a mode preset layered on top, in a fresh run directory under tmp."""
    path = tmp / f"{mode}.yaml"
    path.write_text(f"defaults:\n  - {REPO / base}\n  - {REPO}/configs/presets/{mode}.yaml\n")
    return load_config(path, [f"run.dir={tmp}/{mode}-{time.time_ns()}", "logging.console_every=1000000", *overrides])


def run(cfg: Config, learner_factory=None) -> list[dict]:
    """Train `cfg` in this process (embedded Ray) and return its metrics rows."""
    from async_april.train import train

    train(cfg, learner_factory=learner_factory)
    return read_rows(cfg.run_dir)


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def reward_curve(rows: list[dict], window: int = 10) -> list[tuple[float, float]]:
    """(wall seconds since the first step started, trailing mean reward over `window` steps)."""
    t0 = rows[0]["time/elapsed_s"] - rows[0]["timing_s/step"]
    out = []
    for i, r in enumerate(rows):
        recent = [x["rollout/reward_mean"] for x in rows[max(0, i - window + 1) : i + 1]]
        out.append((r["time/elapsed_s"] - t0, statistics.mean(recent)))
    return out


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, r in curve if r >= target), None)


def final_reward(rewards: list[float], frac: float = 0.2) -> float:
    k = max(1, int(len(rewards) * frac))
    return statistics.mean(rewards[-k:])


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps({**payload, "command": " ".join(sys.argv)}, indent=2))
    return out
