"""Multi-node runs on real raylets (tests/multinode.py): a head and two worker nodes on this
machine, joined through `run.ray_address` as on a real cluster. Placement read back from Ray,
a worker node killed mid-run, the learner's node killed, nodes joining and leaving an elastic
pool, the sync preset against one node, and `ray job submit` onto the cluster.

One cluster for the module (~30 s to start); the runs are tiny (torch engine, the ~1M-parameter
model, 4 groups x 4 samples per step)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from async_april.checkpointing import CheckpointManager
from async_april.config import load_config
from async_april.launch.controller import train
from tests.multinode import LocalCluster
from tests.test_faults import assert_each_prompt_once, rows, store_state

REPO = Path(__file__).resolve().parent.parent
SMALL = ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.max_new_tokens=24", "rollout.concurrency=8",
         "logging.wandb=disabled", "logging.console_every=100", "run.pin_cpus=false"]


@pytest.fixture(scope="module")
def cluster():
    import ray

    c = LocalCluster(head={"num_cpus": 2, "resources": {"head": 1}},
                     workers=[{"num_cpus": 2, "resources": {"w1": 1, "lrn": 1}},
                              {"num_cpus": 2, "resources": {"w2": 1, "lrn": 1}}])
    yield c
    ray.shutdown()
    c.shutdown()


def make_cfg(cluster, tmp_path, *overrides, name="run"):
    return load_config(REPO / "configs/tiny_cpu.yaml",
                       [f"run.dir={tmp_path}/{name}", f"run.ray_address={cluster.address}", *SMALL, *overrides])


def gcs_nodes_of_actors() -> dict[str, str]:
    """Actor id (hex) -> node id, from the GCS's actor table: Ray's own record, independent of the actors."""
    from ray._private.state import state

    return {aid: a["Address"]["NodeID"] for aid, a in state.actor_table(None).items() if a["State"] == "ALIVE"}


def test_placement_is_recorded_as_ray_placed_it_and_a_worker_node_kill_loses_nothing(cluster, tmp_path):
    """3 generation actors spread over 3 nodes, learner on the head (resource:head), store on the
    driver's node. After step 2 the worker node of one generation actor is killed (raylet gone):
    the run finishes its 6 steps, the lost actor's leases went back to the store, its replacement
    runs on a surviving node, every prompt is in exactly one state."""
    import ray

    cfg = make_cfg(cluster, tmp_path, "run.steps=6", "rollout.num_actors=3", "placement.learner=resource:head",
                   "checkpoint.every=3", "async.max_staleness=1", "rollout.max_actor_restarts=2")
    seen = {}

    def on_step(step, batch, learner, pool):
        if step == 1:
            seen["record"] = json.loads((cfg.run_dir / "placement.json").read_text())
            seen["gcs"] = gcs_nodes_of_actors()
            seen["handles"] = {i: h._actor_id.hex() for i, h in pool.actors.items()}
            seen["store"] = pool.store._actor_id.hex()
            seen["learner"] = [w._actor_id.hex() for w in learner.workers]
        if step == 2:
            driver = ray.get_runtime_context().get_node_id()
            on = {i: a["node_id"] for i, a in seen["record"]["actors"].items() if a["role"] == "generation"}
            victim_id, node_id = next((i, n) for i, n in sorted(on.items()) if n != driver)
            deadline = time.monotonic() + 60
            while not ray.get(pool.store.call.remote("leased_by", victim_id)) and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["victim"], seen["victim_node"] = victim_id, node_id
            seen["leased"] = ray.get(pool.store.call.remote("leased_by", victim_id))
            node = next(n for n in cluster.workers if n.node_id == node_id)
            cluster.remove(node)

    train(cfg, on_step=on_step)
    rec, gcs = seen["record"], seen["gcs"]
    driver = rec["driver_node_id"]
    # Every actor ran where Ray's GCS says, and where its placement spec asked.
    for name, hexid in seen["handles"].items():
        assert rec["actors"][name]["node_id"] == gcs[hexid]
    assert rec["actors"]["store"]["node_id"] == gcs[seen["store"]] == driver, "placement.store=driver"
    head_id = cluster.head.node_id
    assert rec["actors"]["learner0"]["node_id"] == gcs[seen["learner"][0]] == head_id, "placement.learner=resource:head"
    assert len({a["node_id"] for a in rec["actors"].values() if a["role"] == "generation"}) == 3, "spread over 3 nodes"
    assert rec["specs"] == {"learner": "resource:head", "store": "driver", "generation": "spread", "eval": "spread"}
    assert len(rec["nodes"]) == 3
    # The node kill: the run finished, the leases came back, the replacement is elsewhere.
    assert seen["leased"], "the victim held no leases when its node was killed; the drill tested nothing"
    out = rows(cfg)
    assert [r["train/step"] for r in out] == list(range(1, 7))
    last = out[-1]
    # (Ray sees the node dead ~1.5 s after the kill: the victim may push some of what it held meanwhile.)
    assert last["rollout/actor_failures"] == 1 and last["rollout/samples_released"] >= 1
    assert last["rollout/actors"] == 3
    final = json.loads((cfg.run_dir / "placement.json").read_text())
    assert seen["victim"] not in final["actors"]
    assert all(a["node_id"] != seen["victim_node"] for a in final["actors"].values())
    assert any(e["actor"] == seen["victim"] and e["event"].startswith("died") for e in final["events"])
    state = store_state(CheckpointManager(cfg.run_dir).list()[-1])
    assert_each_prompt_once(state)
    assert len(state["trained"]) == len(set(state["trained"])) == 6 * cfg.rollout.batch_groups
    assert all(r["staleness/max"] <= 1 for r in out)


def test_the_learners_node_killed_the_run_rebuilds_itself_from_its_checkpoint(cluster, tmp_path):
    """The learner's rank sits on a worker node (resource:lrn, which both workers declare); after step
    3 is trained that node is killed, before step 3's checkpoint. The run restarts from step 2's
    checkpoint (run.max_restarts), its learner on the other worker, trains steps 3-5 again, and ends
    with every prompt trained once and metrics.jsonl holding each step once."""
    cluster.restore()
    cfg = make_cfg(cluster, tmp_path, "run.steps=5", "rollout.num_actors=2", "placement.generation=resource:head",
                   "placement.learner=resource:lrn", "checkpoint.every=1", "checkpoint.keep=5", "run.max_restarts=1")
    seen = {"steps": []}

    def on_step(step, batch, learner):
        seen["steps"].append(step)
        if step == 3 and "killed" not in seen:
            rec = json.loads((cfg.run_dir / "placement.json").read_text())
            seen["killed"] = rec["actors"]["learner0"]["node_id"]
            cluster.remove(next(n for n in cluster.workers if n.node_id == seen["killed"]))

    train(cfg, on_step=on_step)
    assert seen["steps"] == [1, 2, 3, 3, 4, 5], "step 3 trained again after the restart from step 2"
    out = rows(cfg)
    assert [r["train/step"] for r in out] == [1, 2, 3, 4, 5]
    assert [r["run/restarts"] for r in out] == [0, 0, 1, 1, 1]
    assert [r["train/policy_version"] for r in out] == [1, 2, 3, 4, 5]
    rec = json.loads((cfg.run_dir / "placement.json").read_text())
    assert rec["actors"]["learner0"]["node_id"] != seen["killed"]
    state = store_state(CheckpointManager(cfg.run_dir).list()[-1])
    assert_each_prompt_once(state)
    assert len(state["trained"]) == len(set(state["trained"])) == 5 * cfg.rollout.batch_groups


def test_the_learners_node_killed_without_restarts_ends_with_the_resume_command(cluster, tmp_path, capsys):
    """run.max_restarts=0: the run ends with RunStateLost and prints how to resume; resuming it then
    (on the surviving nodes) finishes the steps with nothing lost."""
    from async_april.launch.controller import RunStateLost

    cluster.restore()
    base = ["rollout.num_actors=1", "placement.generation=resource:head", "placement.learner=resource:lrn",
            "checkpoint.every=1", "checkpoint.keep=5", "run.steps=4"]
    cfg = make_cfg(cluster, tmp_path, *base, "run.max_restarts=0")

    def on_step(step, batch, learner):
        if step == 2:
            rec = json.loads((cfg.run_dir / "placement.json").read_text())
            cluster.remove(next(n for n in cluster.workers if n.node_id == rec["actors"]["learner0"]["node_id"]))

    with pytest.raises(RunStateLost, match="run.max_restarts=0 reached"):
        train(cfg, on_step=on_step)
    said = capsys.readouterr().err
    assert "run.resume=auto" in said and "step_00000001" in said
    train(make_cfg(cluster, tmp_path, *base, "run.resume=auto"))
    out = rows(cfg)
    assert [r["train/step"] for r in out] == [1, 2, 3, 4]
    state = store_state(CheckpointManager(cfg.run_dir).list()[-1])
    assert_each_prompt_once(state)
    assert len(state["trained"]) == len(set(state["trained"])) == 4 * cfg.rollout.batch_groups


def test_elastic_pool_grows_onto_a_joining_node_and_shrinks_when_it_leaves(cluster, tmp_path):
    """rollout.num_actors=1-3 on nodes declaring `elastic`: one such node (1 CPU) at the start; a second
    (2 CPUs) joins after step 2 and gets 2 actors at the next step (rollout/actors 1 -> 3 at step 3,
    once their engines started: the hook of step 3 waits for that, as steps here take 0.5 s and a
    fresh node's workers ~10 s to import torch); it is killed after step 6 and the pool falls back to
    1 without an error. Staleness stays within eta; every prompt trained once."""
    cluster.restore()
    first = cluster.add(num_cpus=1, resources={"elastic": 1})
    cluster.wait_for_nodes()
    cfg = make_cfg(cluster, tmp_path, "run.steps=11", "rollout.num_actors=1-3", "placement.generation=resource:elastic",
                   "placement.learner=resource:head", "async.max_staleness=1", "checkpoint.every=11")
    seen = {}

    def on_step(step, batch, learner, pool):
        if step == 2:
            seen["joined"] = cluster.add(num_cpus=2, resources={"elastic": 1})
        if step == 3:
            seen["pending_at_3"] = len(pool.pending)
            t0, deadline = time.monotonic(), time.monotonic() + 120
            while len(pool.actors) < 3 and time.monotonic() < deadline:
                pool.check()
                time.sleep(0.2)
            seen["join_s"] = time.monotonic() - t0
        if step == 6:
            cluster.remove(seen["joined"])

    try:
        train(cfg, on_step=on_step)
    finally:
        cluster.remove(first)
    out = rows(cfg)
    actors = [r["rollout/actors"] for r in out]
    assert [r["train/step"] for r in out] == list(range(1, 12))
    assert seen["pending_at_3"] == 2, "the step after the node joined, two actors were starting on it"
    assert actors[:6] == [1, 1, 1, 3, 3, 3], (actors, seen)
    assert actors[7:] == [1] * 4, actors
    assert [r["rollout/actors_pending"] for r in out][2] == 2
    assert all(r["staleness/max"] <= 1 for r in out)
    state = store_state(CheckpointManager(cfg.run_dir).list()[-1])
    assert_each_prompt_once(state)
    assert len(state["trained"]) == len(set(state["trained"])) == 11 * cfg.rollout.batch_groups
