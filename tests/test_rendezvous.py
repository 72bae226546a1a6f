"""Issue 37 item 7: the rendezvous interfaces (run.gloo_socket_ifname, run.nccl_socket_ifname or each node's
environment), said at start, and a node of a multi-machine cluster whose hostname resolves to loopback
named before any group would hang on it. No second machine here: `node_facts` runs for real with the
resolver monkeypatched (the Debian /etc/hosts line `127.0.1.1 <hostname>`), and the cluster's node list
is a fake of two machines. That the values reach learner ranks and generation actors is checked on real
actors in tests/test_weight_sync.py (`test_socket_ifnames_reach_learner_ranks_and_generation_actors`)."""

from __future__ import annotations

import socket

import pytest

from async_april.config import ConfigError, load_config
from async_april.hosts.network import describe_ifnames, ifname_env, node_facts, rendezvous_problems


def facts(monkeypatch, resolved: str, ip: str, node_id: str, env: dict[str, str] | None = None) -> dict:
    """node_facts() on this machine, its hostname resolving to `resolved` and Ray calling it `ip`."""
    import ray

    monkeypatch.setattr(socket, "gethostname", lambda: "worker7")
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(socket.AF_INET, 1, 6, "", (resolved, 0))])
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ip)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: node_id})())
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    out = node_facts(env or {})
    out["interfaces"] = {"lo": ["127.0.0.1"], "eth0": [ip]}  # the machine the fake node stands for
    return out


def test_a_loopback_hostname_on_a_cluster_of_two_machines_is_named_with_what_to_set(monkeypatch):
    head = facts(monkeypatch, "10.0.0.5", "10.0.0.5", "aa11" * 8)
    bad = facts(monkeypatch, "127.0.1.1", "10.0.0.7", "3f2a91c0" * 4)
    [problem] = rendezvous_problems([head, bad])
    assert problem.startswith("node 3f2a91c0 (10.0.0.7): its hostname 'worker7' resolves to 127.0.1.1 (loopback)")
    assert "set run.gloo_socket_ifname=eth0" in problem and "map 'worker7' to 10.0.0.7 in its /etc/hosts" in problem
    # one machine, several raylets (tests/multinode.py, ray.cluster_utils): loopback reaches every member
    assert rendezvous_problems([facts(monkeypatch, "127.0.0.1", "10.0.0.5", "b" * 32), head]) == []
    # the interface set (config or the node's environment) is what gloo binds: no loopback problem, but
    # an interface the node lacks is named (gloo fails there: "Unable to find address for: ens5")
    fixed = facts(monkeypatch, "127.0.1.1", "10.0.0.7", "c" * 32, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert rendezvous_problems([head, fixed]) == []
    wrong = facts(monkeypatch, "127.0.1.1", "10.0.0.7", "d" * 32, {"GLOO_SOCKET_IFNAME": "ens5"})
    assert rendezvous_problems([head, wrong]) == [
        "node dddddddd (10.0.0.7): GLOO_SOCKET_IFNAME=ens5 but it has no interface ens5 (it has eth0, lo); "
        "set run.gloo_socket_ifname=eth0 or fix it on that node"]
    loop = facts(monkeypatch, "127.0.0.1", "127.0.0.1", "e" * 32)
    assert "Ray's own address for it is loopback" in rendezvous_problems([head, loop])[0]


def test_check_rendezvous_stops_a_gloo_run_and_warns_an_nccl_only_one(monkeypatch, capsys):
    """At start (controller.train): one line saying each backend's interface and its source; a node that
    would hang is a RendezvousError (exit 2, one line) when gloo crosses nodes, a warning otherwise."""
    import ray

    from async_april.launch import cluster, rendezvous

    nodes = [facts(monkeypatch, "10.0.0.5", "10.0.0.5", "a" * 32, {"NCCL_SOCKET_IFNAME": "eth0"}),
             facts(monkeypatch, "127.0.1.1", "10.0.0.7", "b" * 32)]
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 8.0})
    asked = []
    monkeypatch.setattr(cluster, "probe_nodes", lambda env, fn, what: asked.append((env, fn, what)) or nodes)

    cpu = load_config(None, ["learner.device=cpu", "run.nccl_socket_ifname=^docker,lo"])
    with pytest.raises(rendezvous.RendezvousError, match=r"node bbbbbbbb \(10.0.0.7\): its hostname 'worker7'"):
        rendezvous.check_rendezvous(cpu)
    assert asked[0][0] == {"NCCL_SOCKET_IFNAME": "^docker,lo"} and asked[0][1] is node_facts
    gpu = load_config(None, ["learner.device=cuda"])
    line = rendezvous.check_rendezvous(gpu)
    assert "warning: node bbbbbbbb (10.0.0.7)" in capsys.readouterr().err
    assert line == ("rendezvous: gloo GLOO_SOCKET_IFNAME from each node's environment: unset on 2 nodes; "
                    "nccl NCCL_SOCKET_IFNAME from each node's environment: eth0 on 1 node, unset on 1 node")
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])  # one node: no probe, nothing to name
    assert rendezvous.check_rendezvous(cpu) == (
        "rendezvous: gloo GLOO_SOCKET_IFNAME unset (the hostname's choice); nccl NCCL_SOCKET_IFNAME=^docker,lo "
        "(run.nccl_socket_ifname, set in every learner rank and engine)") and len(asked) == 2


def test_socket_ifname_config_is_typed_and_becomes_the_environment():
    cfg = load_config(None, ["run.gloo_socket_ifname=eth0,eth1", "run.nccl_socket_ifname==ib0"])
    assert ifname_env(cfg) == {"GLOO_SOCKET_IFNAME": "eth0,eth1", "NCCL_SOCKET_IFNAME": "=ib0"}
    assert ifname_env(load_config(None, [])) == {}
    assert describe_ifnames(cfg, None).startswith("rendezvous: gloo GLOO_SOCKET_IFNAME=eth0,eth1 (run.gloo_socket_ifname")
    for bad in ("run.gloo_socket_ifname=^eth0", "run.nccl_socket_ifname='eth 0'", "run.gloo_socket_ifname=a_very_long_name0"):
        with pytest.raises(ConfigError, match=r"run\.(gloo|nccl)_socket_ifname=.* is not a network interface name"):
            load_config(None, [bad])
