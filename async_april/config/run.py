"""Run-level sections: the run itself, checkpoints, logging."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_april.config.base import Section


class RunConfig(Section):
    name: str = "tiny-reverse"
    """Run name, used for the W&B run and the console line."""
    dir: str = "runs/${name}"
    """Run directory: config.yaml, metrics.jsonl and checkpoints go here. `${name}` expands to `run.name`."""
    steps: int = Field(40, ge=1, le=10_000_000)
    """Number of learner steps (one rollout batch each; `learner.mini_batches` optimizer updates per step)."""
    seed: int = Field(1234, ge=0)
    """Seed for data order, sampling and model initialisation."""
    ray_address: str | None = None
    """Ray cluster address. None: join the cluster when run under `ray job submit`, else start an embedded one."""
    max_restarts: int = Field(2, ge=0, le=100)
    """Times the run rebuilds itself from its last checkpoint when a learner rank or the rollout store is lost (its node died): learner and store restored, generation actors restarted, the steps since that checkpoint trained again (nothing lost or trained twice). Needs a checkpoint (`checkpoint.every`); beyond it, or without one, the run ends with the command that resumes it."""
    resume: str | None = None
    """Checkpoint to resume from: a path, `auto` (latest in the run directory) or None. A run directory that already holds a run is only reused with this or `overwrite`."""
    overwrite: bool = False
    """Start from scratch in a run directory that already holds a run: its contents are first moved to `<run.dir>.old-<UTC time>` next to it (delete that yourself). Cannot be combined with `resume`."""
    pin_cpus: bool = False
    """CPU runs on one machine: pin each generation actor to a core of its own and the learner, store and driver to the other cores, as a cluster dedicates GPUs (async_april/cpu_pinning.py). Needs Linux and rollout.num_actors + 1 cores; otherwise a warning and no pinning."""


class CheckpointConfig(Section):
    every: int = Field(0, ge=0)
    """Save a checkpoint every this many steps; 0 saves only at the end."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept in the run directory; older ones are deleted."""
    export_hf: bool = False
    """Also export the final weights as a Hugging Face model directory."""
    verify: Literal["sha256", "size"] = "sha256"
    """How a checkpoint is checked against its manifest when resuming: file sizes and sha256 (reads every byte), or sizes only (fast for very large checkpoints)."""


class LoggingConfig(Section):
    wandb: Literal["online", "offline", "disabled"] = "disabled"
    """Weights & Biases mode. API keys come from the environment and are never saved."""
    project: str = "async-april"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""
    console_every: int = Field(1, ge=1)
    """Print a one-line summary every this many steps."""
