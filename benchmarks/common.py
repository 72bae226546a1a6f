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
    # No held-out evaluation (the tiny config evaluates every 20 steps): these figures compare training
    # alone, as when they were recorded; benchmarks/eval_overhead.py measures what evaluation costs.
    return load_config(path, [f"run.dir={tmp}/{mode}-{time.time_ns()}", "logging.console_every=1000000",
                              "eval.datasets=[]", *overrides])


def run(cfg: Config, learner_factory=None) -> list[dict]:
    """Train `cfg` in this process (embedded Ray) and return its metrics rows."""
    from async_april.launch.controller import train

    train(cfg, learner_factory=learner_factory)
    return read_rows(cfg.run_dir)


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


WINDOW = 10
"""Steps in the trailing reward mean. Points start once the window is full: the first batches of
the april and async modes are biased towards short (easier) responses, which finish first, so a
partial window would 'reach' a target in the first seconds."""


def trailing_curve(times: list[float], rewards: list[float], window: int = WINDOW) -> list[tuple[float, float]]:
    return [(times[i], statistics.mean(rewards[i - window + 1 : i + 1])) for i in range(window - 1, len(rewards))]


def reward_curve(rows: list[dict], window: int = WINDOW) -> list[tuple[float, float]]:
    """(wall seconds since the first step started, trailing mean reward over `window` steps)."""
    t0 = rows[0]["time/elapsed_s"] - rows[0]["timing_s/step"]
    return trailing_curve([r["time/elapsed_s"] - t0 for r in rows], [r["rollout/reward_mean"] for r in rows], window)


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
