"""Cross-node rendezvous: the network interface gloo and NCCL use, and hostnames that resolve to loopback.

Every rendezvous address of a run is a Ray node address (`ray.util.get_node_ip_address()`): learner
rank 0's node for the learner's own group (learners/group.py MASTER_ADDR) and for the weight group
(LearnerGroup.free_port_on_rank0; SGLang servers connect there). That store is reachable. What each
member then offers its peers is chosen by the backend:
- gloo binds GLOO_SOCKET_IFNAME if set, else the address the node's hostname resolves to (torch
  ProcessGroupGloo.cpp `createDefaultDevice`: a hostname that resolves to a bindable address is used,
  and 127.0.1.1, the Debian /etc/hosts line for the hostname, is bindable). A member on another machine
  then connects to 127.0.1.1, itself, and the rendezvous hangs until its timeout;
- NCCL binds NCCL_SOCKET_IFNAME if set, else an interface it picks (InfiniBand first, then any that is
  not loopback or docker: NCCL's ncclFindInterfaces); the hostname plays no part.

The config (`run.gloo_socket_ifname`, `run.nccl_socket_ifname`) wins when set: it is forwarded to every
learner rank and generation actor (`ifname_env`), and so to the SGLang servers they launch. Unset, each
process keeps its own environment (its node's `ray start`, or the job's runtime_env). At start the
driver says which in one line and, when the cluster spans machines, names every node whose hostname
resolves to loopback while gloo has no interface there (`rendezvous_problems`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections import Counter
from typing import Any

IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def ifname_env(cfg) -> dict[str, str]:
    """The interface variables the config sets, for a runtime_env's env_vars (empty when none is set)."""
    values = {"gloo": cfg.run.gloo_socket_ifname, "nccl": cfg.run.nccl_socket_ifname}
    return {IFNAME_ENV[b]: v for b, v in values.items() if v is not None}


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def node_facts(forwarded: dict[str, str]) -> dict[str, Any]:
    """What this node offers a rendezvous (run as a task on each node): its Ray address, hostname and what
    that resolves to, its interfaces' IPv4 addresses, and each backend's interface variable as this run's
    processes there see it (the node's environment with the config's values over it)."""
    import psutil  # a Ray dependency
    import ray

    host = socket.gethostname()
    try:
        resolved = sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except OSError:
        resolved = []
    env = {**os.environ, **forwarded}
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "hostname": host, "resolved": resolved,
            "interfaces": {name: [a.address for a in addrs if a.family == socket.AF_INET]
                           for name, addrs in psutil.net_if_addrs().items()},
            "env": {var: env.get(var) for var in IFNAME_ENV.values()}}


def interface_of(facts: dict[str, Any], address: str) -> str | None:
    return next((name for name, addrs in facts["interfaces"].items() if address in addrs), None)


def rendezvous_problems(nodes: list[dict[str, Any]]) -> list[str]:
    """One sentence per node a cross-machine gloo rendezvous would hang on (`node_facts` of every live
    node). Nodes that share one address are one machine (several raylets of a test cluster): loopback
    reaches every member there, so nothing is a problem unless the cluster spans machines."""
    if len({n["ip"] for n in nodes}) < 2:
        return []
    out = []
    for n in nodes:
        where = f"node {n['node_id'][:8]} ({n['ip']})"
        if is_loopback(n["ip"]):
            out.append(f"{where}: Ray's own address for it is loopback, so no other machine reaches its rendezvous; "
                       "start its raylet with `ray start --node-ip-address=<its address>`")
            continue
        ifname = interface_of(n, n["ip"]) or "<the interface holding " + n["ip"] + ">"
        wanted = n["env"].get(IFNAME_ENV["gloo"])
        if wanted:
            missing = [w for w in wanted.split(",") if w not in n["interfaces"]]
            if missing:
                out.append(f"{where}: GLOO_SOCKET_IFNAME={wanted} but it has no interface {', '.join(missing)} (it has "
                           f"{', '.join(sorted(n['interfaces']))}); set run.gloo_socket_ifname={ifname} or fix it on that node")
        elif n["resolved"] and all(is_loopback(a) for a in n["resolved"]):
            out.append(f"{where}: its hostname {n['hostname']!r} resolves to {', '.join(n['resolved'])} (loopback), which "
                       "gloo would offer the other machines, hanging the rendezvous; set run.gloo_socket_ifname="
                       f"{ifname} (or GLOO_SOCKET_IFNAME on that node before `ray start`), or map {n['hostname']!r} to "
                       f"{n['ip']} in its /etc/hosts")
    return out


def describe_ifnames(cfg, nodes: list[dict[str, Any]] | None) -> str:
    """The start-up line: which interface each backend uses and where that came from."""
    parts = []
    for backend, var in IFNAME_ENV.items():
        configured = getattr(cfg.run, f"{backend}_socket_ifname")
        if configured is not None:
            parts.append(f"{backend} {var}={configured} (run.{backend}_socket_ifname, set in every learner rank and engine)")
        elif nodes is None:
            value = os.environ.get(var)
            parts.append(f"{backend} {var}={value} (this machine's environment)" if value else
                         f"{backend} {var} unset ({'the hostname' if backend == 'gloo' else 'NCCL'}'s choice)")
        else:
            seen = Counter(n["env"].get(var) or "unset" for n in nodes)
            parts.append(f"{backend} {var} from each node's environment: "
                         + ", ".join(f"{v} on {c} node{'s' * (c > 1)}" for v, c in sorted(seen.items())))
    return "rendezvous: " + "; ".join(parts)
