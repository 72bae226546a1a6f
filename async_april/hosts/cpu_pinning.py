"""CPU runs on one machine: a core of its own for each generation engine, as a cluster gives it a GPU.

On a small CPU machine the engine, the learner ranks, the rollout store and the
driver all share every core, so the scheduler time-slices the engine against the
learner and neither runs at the speed it has alone. With `run.pin_cpus` each
generation actor is pinned to one of the last `num_actors` cores and everything
else to the cores before them: the engines keep their single-core speed (the
ceiling `benchmarks/rollout_throughput.py` measures), the way a GPU cluster
dedicates devices to generation and training.

Linux only (`os.sched_setaffinity`), one machine only (core numbers are local),
and only where the cores suffice; otherwise `cpu_plan` says why and nothing is
pinned. Every thread of the calling process is pinned, and threads or processes
it starts later inherit the mask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuPlan:
    engine_cores: tuple[int, ...]
    """One core per generation actor."""
    other_cores: tuple[int, ...]
    """Learner ranks, the rollout store and the driver share these."""

    def engine_core(self, actor_index: int) -> int:
        return self.engine_cores[actor_index % len(self.engine_cores)]


def cpu_plan(num_actors: int, cores: list[int] | None = None) -> tuple[CpuPlan | None, str]:
    """The core split for `num_actors` engines, or None and the reason it cannot be made."""
    if not hasattr(os, "sched_setaffinity"):
        return None, "CPU pinning needs Linux (os.sched_setaffinity)"
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < num_actors + 1:
        return None, f"CPU pinning needs rollout.num_actors + 1 = {num_actors + 1} cores, this machine allows {len(cores)}"
    return CpuPlan(tuple(cores[-num_actors:]), tuple(cores[:-num_actors])), ""


def pin_process(cores: tuple[int, ...] | set[int]) -> None:
    """Pin every existing thread of this process to `cores` (sched_setaffinity(0) alone pins one thread)."""
    mask = set(cores)
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just exited, or one we may not touch: nothing to pin


def process_cores() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
