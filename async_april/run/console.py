"""What a person watching a run sees: one-line messages, progress with ETA, the per-step line, the summary.

In a terminal (stderr is a TTY) long work -- building the tiny model, tokenising
a dataset, starting engines, training -- shows a tqdm bar with its ETA, and the
per-step line is written above the training bar. Anywhere else (`ray job logs`,
CI, a pipe) there are no bars: long work prints a line when it starts, a note at
most every NOTE_EVERY_S while it runs, and a line when it ends, and training
prints exactly one line per step (`logging.console_every`) with its ETA:

    [12/200] reward 0.415 | len 8.6 | loss -0.1400 | ... | sync 0.03s | eta 3m41s

Per-step lines go to stdout, everything else to stderr.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

NOTE_EVERY_S = 30.0
"""Without a terminal, the longest silence while long work runs (an SGLang start can take minutes)."""

CONSOLE_KEYS = (
    ("rollout/reward_mean", "reward {:.3f}"),
    ("rollout/response_len_mean", "len {:.1f}"),
    ("loss/policy", "loss {:+.4f}"),
    ("staleness/max", "stale {:.0f}"),
    ("perf/rollout_tokens_per_s", "gen {:.0f} tok/s"),
    ("timing_s/rollout", "wait {:.2f}s"),
    ("timing_s/train", "train {:.2f}s"),
    ("timing_s/weight_sync", "sync {:.2f}s"),
)


def interactive() -> bool:
    """Bars only when a person is watching a terminal."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def say(msg: str) -> None:
    """One `[async-april] ...` line on stderr, above any bar."""
    tqdm.write(f"[async-april] {msg}", file=sys.stderr)
    sys.stderr.flush()


def duration(seconds: float) -> str:
    """`42s`, `3m41s`, `2h05m`."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class _Lines:
    """Stand-in for a bar without a terminal: counts, and prints a note at most every NOTE_EVERY_S."""

    def __init__(self, desc: str, total: int | None, unit: str):
        self.desc, self.total, self.unit, self.n = desc, total, unit, 0
        self._t0 = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, note: str) -> None:
        if note and time.monotonic() - self._last >= NOTE_EVERY_S:
            self._last = time.monotonic()
            done = f"{self.n}/{plural(self.total, self.unit)}, " if self.total else ""
            say(f"{self.desc}: {done}{duration(self._last - self._t0)} so far; {note}")


@contextlib.contextmanager
def stage(desc: str, total: int | None = None, unit: str = "it") -> Iterator[Any]:
    """Long work: yields an object with `update(n)` and `set_postfix_str(note)`; a bar with ETA in a
    terminal, else a line at the start, throttled notes, and a line at the end."""
    t0 = time.perf_counter()
    if interactive():
        with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
            yield bar
            n = bar.n
    else:
        say(f"{desc}{f' ({plural(total, unit)})' if total else ''} ...")
        lines = _Lines(desc, total, unit)
        yield lines
        n = lines.n
    say(f"{desc}: done ({plural(n, unit)}) in {duration(time.perf_counter() - t0)}")


def plural(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def step_line(row: dict[str, Any], total_steps: int) -> str:
    """The one-line summary of a metrics row: `[12/200] reward 0.415 | len 8.6 | ...`."""
    parts = [fmt.format(row[k]) for k, fmt in CONSOLE_KEYS if isinstance(row.get(k), (int, float))]
    return f"[{row.get('train/step', 0):.0f}/{total_steps}] " + " | ".join(parts)


class TrainingProgress:
    """The training bar (terminal) or one line per step (anything else), both with an ETA."""

    def __init__(self, total_steps: int, done_steps: int, console_every: int = 1):
        self.total, self.done_at_start, self.every = total_steps, done_steps, console_every
        self._t0: float | None = None
        self._bar = None

    def start(self) -> None:
        """The clock (and the bar) start with the first step, so that start-up time does not skew the ETA."""
        self._t0 = time.perf_counter()
        if interactive():
            self._bar = tqdm(total=self.total, initial=self.done_at_start, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True)

    def eta_s(self, step: int) -> float:
        done = step - self.done_at_start
        return (time.perf_counter() - self._t0) / done * (self.total - step) if done > 0 else math.inf

    def step(self, row: dict[str, Any]) -> None:
        if self._t0 is None:
            self.start()
        step = int(row.get("train/step", 0))
        line = f"{step_line(row, self.total)} | eta {duration(self.eta_s(step))}"
        show = step % self.every == 0 or step == self.total
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if isinstance(row.get("rollout/reward_mean"), (int, float)):
                self._bar.set_postfix_str(f"reward {row['rollout/reward_mean']:.3f}")
            if show:
                tqdm.write(line, file=sys.stdout)
        elif show:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def run_summary(rows: list[dict[str, Any]], run_dir: Path, checkpoint: Path | None) -> str:
    """One line at the end of a run: steps, wall time (across resumes), mean reward of the first 10%
    -> the last 20% of steps, trained tokens per second of step time, the run directory and the
    last checkpoint."""
    if not rows:
        return f"no step finished | run dir {run_dir}"
    rewards = [r["rollout/reward_mean"] for r in rows if isinstance(r.get("rollout/reward_mean"), (int, float))]
    head = rewards[: max(1, math.ceil(len(rewards) * 0.1))]
    tail = rewards[-max(1, math.ceil(len(rewards) * 0.2)):]
    wall = float(rows[-1].get("time/elapsed_s", 0.0))
    tokens = sum(r.get("rollout/tokens", 0) for r in rows)
    step_s = sum(r.get("timing_s/step", 0.0) for r in rows)
    parts = [f"{int(rows[-1].get('train/step', len(rows)))} steps in {duration(wall)}"]
    if rewards:
        parts.append(f"reward {sum(head) / len(head):.3f} (first 10%) -> {sum(tail) / len(tail):.3f} (last 20%)")
    if step_s > 0:
        parts.append(f"{tokens / step_s:,.0f} trained tokens/s")
    parts.append(f"run dir {run_dir}")
    parts.append(f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint")
    return " | ".join(parts)
