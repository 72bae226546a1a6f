"""Run-level sections: the run itself, checkpoints, logging."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

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
    placement_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Longest the run waits for the cluster to have room for what it must place: the learner's ranks, the generation actors it starts with, and, after a lost node, the whole layout before the rebuild (nodes may rejoin meanwhile). Beyond it the run stops with one line naming what found no room and what each needs; checkpoints are kept. Replacements and elastic joiners wait as pending instead (the pool shrinks rather than stops)."""
    resume: str | None = None
    """Checkpoint to resume from: a path, `auto` (latest in the run directory) or None. A run directory that already holds a run is only reused with this or `overwrite`."""
    overwrite: bool = False
    """Start from scratch in a run directory that already holds a run: its contents are first moved to `<run.dir>.old-<UTC time>` next to it (delete that yourself). Cannot be combined with `resume`."""
    pin_cpus: bool = False
    """CPU runs on one machine: pin each generation actor to a core of its own and the learner, store and driver to the other cores, as a cluster dedicates GPUs (async_april/hosts/cpu_pinning.py). Needs Linux and rollout.num_actors + 1 cores; otherwise a warning and no pinning."""


    gloo_socket_ifname: str | None = None
    """Network interface gloo binds in every group that crosses nodes (learner ranks on CPU or with `learner.offload_optimizer`, the weight group from CPU ranks): set as GLOO_SOCKET_IFNAME in every learner rank and generation actor (and the SGLang server it launches), over their environment. None: each process keeps its own environment's (its node's `ray start` environment, or the job's runtime_env); without one torch binds the address the node's hostname resolves to, which on a Debian-style /etc/hosts is 127.0.1.1 and hangs a cross-node rendezvous (checked at start, docs/cluster.md). One name or a comma-separated list, e.g. `eth0`."""
    nccl_socket_ifname: str | None = None
    """NCCL's bootstrap and socket interface, set as NCCL_SOCKET_IFNAME the same way (the config wins over the environment; None keeps each process's own). NCCL's syntax: prefixes `eth,ib`, exact `=eth0`, or excluded `^docker,lo`. None and unset: NCCL picks one itself."""

    @field_validator("gloo_socket_ifname", "nccl_socket_ifname")
    @classmethod
    def _check_ifname(cls, value: str | None, info) -> str | None:
        prefix = "[\\^=]?" if info.field_name == "nccl_socket_ifname" else ""
        if value is not None and not re.fullmatch(prefix + IFNAME + "(," + IFNAME + ")*", value):
            raise ValueError(f"run.{info.field_name}={value!r} is not a network interface name (or a comma-separated list of them), e.g. eth0; "
                             "list a node's interfaces with `ip -br addr`")
        return value


IFNAME = r"[A-Za-z0-9_.:@-]{1,15}"
"""One Linux interface name: at most IFNAMSIZ - 1 = 15 characters, no spaces or slashes (net/core/dev.c dev_valid_name)."""


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
