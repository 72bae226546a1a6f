"""At start: the rendezvous interfaces of a run, said in one line, and nodes that would hang it named.

    check_rendezvous(cfg) -> str   one line (async_april/hosts/network.py `describe_ifnames`); with more than
                                   one live node, `node_facts` from every node first, and a node whose
                                   hostname resolves to loopback (or whose configured interface is
                                   missing) on a cluster that spans machines is a RendezvousError when the
                                   run uses gloo across nodes, a warning when its groups are NCCL only
"""

from __future__ import annotations

from async_april.config import Config
from async_april.run.console import say
from async_april.errors import UserError
from async_april.hosts.network import describe_ifnames, ifname_env, node_facts, rendezvous_problems


class RendezvousError(UserError, RuntimeError):
    """A node of a multi-machine cluster would hang a gloo rendezvous (its address offered to peers is loopback)."""


def uses_gloo(cfg: Config, cluster_gpus: float) -> bool:
    """Whether a group of this run runs over gloo: CPU learner ranks (their own group, and the weight group
    from them: weight_buckets.broadcast_backend), or offloaded optimizer state (learners/worker.py cpu:gloo)."""
    lc = cfg.learner
    on_cpu = lc.device == "cpu" or (lc.device == "auto" and cluster_gpus < 1)
    return on_cpu or lc.offload_optimizer


def check_rendezvous(cfg: Config) -> str:
    import ray

    from async_april.launch.cluster import probe_nodes

    nodes = None
    if sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
        nodes = probe_nodes(ifname_env(cfg), fn=node_facts, what="rendezvous probe")
    problems = rendezvous_problems(nodes or [])
    if problems and uses_gloo(cfg, ray.cluster_resources().get("GPU", 0.0)):
        raise RendezvousError("; ".join(problems))
    if problems:
        say("warning: " + "; ".join(problems) + " (this run's groups are NCCL only, and NCCL picks its interface "
            "itself: it goes on, but a gloo group there would hang)")
    return describe_ifnames(cfg, nodes)
