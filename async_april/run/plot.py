"""`async-april plot RUN_DIR [--out FILE]`: reward (training, and each held-out eval set's mean and
greedy reward at the policy version it evaluated), response length, rollout throughput and staleness
over steps, from the run's metrics.jsonl, as one PNG (no W&B needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from async_april.errors import PlotError, one_line
from async_april.structured import loads_json

PANELS = (
    ("rollout/reward_mean", "reward (mean)"),
    ("rollout/response_len_mean", "response length (tokens)"),
    ("perf/rollout_tokens_per_s", "rollout tokens/s"),
    ("staleness/max", "staleness (versions)"),
)


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`. A cut-short last line (a run killed while writing it) is
    skipped with a warning; anything else unreadable is a PlotError naming the line."""
    from async_april.run.console import say

    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory; give a run directory (the run's run.dir)")
    if not path.is_file():
        raise PlotError(f"{run_dir} holds no metrics.jsonl: not a run directory, or no step has finished yet")
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = loads_json(line)  # bounded depth: a line nested 10^5 deep is "not JSON", not a RecursionError
        except ValueError as e:
            if i == len(lines):
                say(f"warning: {path}: line {i} is cut short (the run stopped while writing it); plotting the rows before it")
                continue
            raise PlotError(f"{path}: line {i} is not JSON ({one_line(str(e), 200)}); fix or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("train/step"), (int, float)):
            raise PlotError(f"{path}: line {i} has no train/step; is this an async-april metrics file?")
        rows.append(row)
    if not rows:
        raise PlotError(f"{path} has no rows yet; plot once a step has finished")
    return rows


def eval_curves(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per eval set, (policy version evaluated, reward) for its mean and greedy reward. An evaluation is
    logged in the row of the step at which it finished, so it is placed at the version it evaluated
    (the step that produced those weights), beside the training reward of that step."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("eval/") and key.endswith(("/mean_reward", "/greedy_reward")):
                name, metric = key.split("/")[1], key.rsplit("/", 1)[1]
                version = r.get(f"eval/{name}/version")
                if isinstance(version, (int, float)):
                    curves.setdefault(f"eval {name} {metric.removesuffix('_reward')}", []).append((version, value))
    return {k: sorted(v) for k, v in curves.items()}


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
            ax.plot(*zip(*pts), label="train" if key == "rollout/reward_mean" else key.split("/")[-1])
        if key == "rollout/reward_mean":
            for label, curve in eval_curves(rows).items():
                ax.plot(*zip(*curve), marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in ("staleness/max", "rollout/reward_mean") and len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=8)
    out = output_path(run_dir, out)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=90, format="png")
    plt.close(fig)
    return out


def output_path(run_dir: Path, out: Path | None) -> Path:
    """Where the PNG goes: RUN_DIR/metrics.png by default, DIR/metrics.png for an existing directory
    DIR, else `out`, which must end in .png (matplotlib would append `.png` to a name without a suffix
    and write a file the caller was not told about). Its parent is created; PlotError if it cannot be."""
    if out is None:
        return run_dir / "metrics.png"
    if out.is_dir():
        return out / "metrics.png"
    if out.suffix.lower() != ".png":
        raise PlotError(f"--out {str(out)!r}: give a file name ending in .png, or an existing directory "
                        "(the plot is then written there as metrics.png)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlotError(f"--out {str(out)!r}: cannot create {out.parent} ({e.strerror}); give a writable location") from None
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
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/metrics.png)")
    a = ap.parse_args(argv)
    print(plot_run(a.run_dir, a.out))
