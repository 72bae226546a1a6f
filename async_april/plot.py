"""`async-april plot RUN_DIR [--out FILE]`: reward, response length, rollout throughput and
staleness over steps, from the run's metrics.jsonl, as one PNG (no W&B needed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (
    ("rollout/reward_mean", "reward (mean)"),
    ("rollout/response_len_mean", "response length (tokens)"),
    ("perf/rollout_tokens_per_s", "rollout tokens/s"),
    ("staleness/max", "staleness (versions)"),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["train/step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if key == "staleness/max":
            mean = [(r["train/step"], r["staleness/mean"]) for r in rows if "staleness/mean" in r]
            if mean:
                ax.plot(*zip(*mean), label="mean")
        if pts:
            ax.plot(*zip(*pts), label=key.split("/")[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "staleness/max":
            ax.legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = out or run_dir / "metrics.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_curves(curves: dict[str, list[tuple[float, float]]], out: Path, xlabel: str, ylabel: str,
                hline: float | None = None) -> Path:
    """One line per labelled (x, y) curve, e.g. reward against wall time per mode and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in curves.items():
        if pts:
            ax.plot(*zip(*pts), label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="async-april plot", description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    print(plot_run(a.run_dir, a.out))
