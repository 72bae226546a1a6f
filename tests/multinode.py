"""A multi-node Ray cluster on this machine, for tests and benchmarks: a head and worker raylets
(`ray.cluster_utils.Cluster`), each its own raylet with its own object store and declared
resources (CPUs, GPUs as plain numbers, custom ones), in a temp dir of its own. Runs join it
through `run.ray_address` exactly as on a real cluster. Stopped by `shutdown()`, which kills this
cluster's own processes (never `ray stop`, which would stop every Ray on the machine).

Node death is detected in ~1.5 s (health checks every 500 ms, 3 misses) instead of Ray's default
~15 s, so that a killed node's actors are seen dead within a step.
"""

from __future__ import annotations

import shutil
import tempfile
import time

OBJECT_STORE_BYTES = 120 * 2**20
"""Per node: the tests' weights are ~4 MB; Ray's default would take 30% of RAM per raylet."""

SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


class LocalCluster:
    """`LocalCluster(head={"num_cpus": 2, "resources": {"head": 1}}, workers=[{...}, ...])`."""

    def __init__(self, head: dict, workers: list[dict], dashboard: bool = False):
        from ray.cluster_utils import Cluster

        self.tmp = tempfile.mkdtemp(prefix="aa-mn-", dir="/tmp")
        t0 = time.monotonic()
        head_args = {"object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": dashboard,
                     "_system_config": SYSTEM_CONFIG, "temp_dir": self.tmp, **head}
        if dashboard:
            head_args.setdefault("dashboard_port", _free_port())
            # Its own job agent port too: the default (52365) is taken by any other Ray on the machine, and
            # then the head's agent never registers and `ray job submit` waits for it forever.
            head_args.setdefault("dashboard_agent_listen_port", _free_port())
        self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        self.head = self.cluster.head_node
        self.layout = [dict(w) for w in workers]
        self.workers = [self.add(**w) for w in workers]
        self.cluster.wait_for_nodes()
        self.start_s = time.monotonic() - t0
        self.address = self.cluster.address
        self.dashboard_url = self.head.address_info.get("webui_url") if dashboard else None

    def add(self, **node_args):
        node_args.setdefault("dashboard_agent_listen_port", _free_port())  # as the head's: never the shared default
        node = self.cluster.add_node(object_store_memory=OBJECT_STORE_BYTES, **node_args)
        return node

    def restore(self) -> None:
        """Add back the workers of the original layout that a test removed (its custom resources tell them apart)."""
        have = [_resources(n) for n in self.workers]
        missing = [w for w in self.layout if w.get("resources", {}) not in have]
        for w in missing:
            self.workers.append(self.add(**w))
        if missing:
            self.cluster.wait_for_nodes()

    def wait_for_nodes(self) -> None:
        self.cluster.wait_for_nodes()

    def remove(self, node, wait_dead: bool = False) -> None:
        """Kill one node's raylet and its workers without warning (a lost machine). `wait_dead`: return
        only once the GCS marks it dead (and with it its actors), ~1.5 s later: until then a worker
        process of that node may still answer a call, so what fails first would depend on timing."""
        self.cluster.remove_node(node, allow_graceful=False)
        if node in self.workers:
            self.workers.remove(node)
        if wait_dead:
            from async_april.launch.cluster import node_seen_dead

            assert node_seen_dead(node.node_id, within_s=60), f"node {node.node_id[:8]} still alive 60 s after its raylet was killed"

    def node_with(self, resource: str):
        return next(n for n in [self.head, *self.workers] if resource in _resources(n))

    def shutdown(self) -> None:
        self.cluster.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def load_model_on_this_node(model_cfg, driver_path) -> str:
    """Run on a node (a task): where an engine or learner rank there loads the model, or the error it gets.
    Here, not in a test module, so that Ray's workers can import it by name."""
    from async_april.models.paths import model_path_on_this_node

    try:
        return str(model_path_on_this_node(model_cfg, driver_path))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"


def _resources(node) -> dict:
    return dict(getattr(node, "_ray_params").resources or {})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
