"""Fault drills, one per row of docs/reliability.md: the store lost, job kill + resume (sync and
async), a truncated checkpoint, bad rewards, NaN loss, SGLang down, invalid config, secrets. (A
generation actor's death and its node's: tests/test_multinode.py.)

Every run shares one embedded Ray cluster (module fixture) and a small config, so the whole
file costs a few minutes on 2 cores. Over 400 lines for that reason: split, the drills would start
the cluster once per file."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from async_april.run.checkpoints import CheckpointManager
from async_april.config import ConfigError, load_config
from async_april.models.paths import resolve_model_path
from async_april.launch.controller import init_ray, train

REPO = Path(__file__).resolve().parent.parent
SMALL = ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.max_new_tokens=24", "rollout.concurrency=16",
         "logging.wandb=disabled", "logging.console_every=100"]


def make_cfg(tmp_path, *overrides, name="run"):
    return load_config(REPO / "configs/tiny_cpu.yaml", [f"run.dir={tmp_path}/{name}", *SMALL, *overrides])


@pytest.fixture(scope="module")
def cluster():
    import ray

    started = init_ray(make_cfg(Path("/tmp"), "rollout.num_actors=3"))
    yield
    if started:
        ray.shutdown()


def rows(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def store_state(ckpt_dir: Path) -> dict:
    from async_april.run import state_codec

    return state_codec.load(ckpt_dir, "store")


def assert_each_prompt_once(state: dict) -> None:
    """The accounting invariant on a saved store state: every prompt taken is in exactly one state."""
    from collections import Counter

    leased = {uid for held in state["leases"].values() for uid in held}
    assert not leased, "a saved store holds no leases (they are folded into partials)"
    seen = Counter(state["trained"] + state["filtered"] + state["dropped"] + state.get("skipped", [])
                   + [g.prompt_index for g in state["completed"]] + list(state["open_groups"]))
    assert sorted(seen) == list(range(state["cursor"])), "a prompt taken from the dataset was lost"
    assert max(seen.values()) == 1, f"a prompt is in two states: {[p for p, c in seen.items() if c > 1]}"


# --------------------------------------------------------------------------- the store lost
# (A generation actor's death, and its node's: tests/test_multinode.py, on a real multi-node cluster.)
def test_the_store_killed_mid_run_is_restored_from_the_last_checkpoint(cluster, tmp_path, capsys, caplog):
    """The RolloutStoreActor killed (`ray.kill`) after step 3 is trained, before its checkpoint: with
    run.max_restarts=1 the run rebuilds itself (store, learner, actors) from step 2's checkpoint, saying
    that the store died, trains step 3 again and finishes with each step once and every prompt trained
    once; with run.max_restarts=0 it ends with RunStateLost and the command that resumes it.
    rollout.max_actor_restarts=1 is for the whole run (issue 37 item 6): gen0 is killed at step 2 and
    replaced at step 3, after step 2's checkpoint; the rebuild from that checkpoint keeps the count (the
    rows after it say 1, not 0), so the actor killed at step 4 is not replaced and the run ends on one."""
    import ray

    from async_april.launch.controller import RunStateLost

    base = ["rollout.num_actors=1", "checkpoint.every=1", "checkpoint.keep=5", "run.steps=4"]
    cfg = make_cfg(tmp_path, "rollout.num_actors=2", "rollout.max_actor_restarts=1", "checkpoint.every=1",
                   "checkpoint.keep=6", "run.steps=5", "run.max_restarts=1")
    seen = {"steps": [], "stores": []}

    def on_step(step, batch, learner, pool):
        seen["steps"].append(step)
        seen["stores"].append(pool.store)
        if step == 2:
            pool.kill("gen0")  # handled at step 3: its replacement is the run's one restart
        if step == 3 and "killed" not in seen:
            seen["killed"] = pool.store
            ray.kill(pool.store)
        if step == 4:
            pool.kill(sorted(pool.actors)[0])  # the budget is spent: not replaced

    caplog.set_level(logging.WARNING, logger="actors.pool")
    train(cfg, on_step=on_step)
    assert seen["steps"] == [1, 2, 3, 3, 4, 5], "step 3 trained again after the restart from step 2"
    assert seen["stores"][3] != seen["killed"], "the restarted run has a store of its own"
    assert "run state lost (the rollout store died (" in capsys.readouterr().err
    out = rows(cfg)
    assert [r["train/step"] for r in out] == [1, 2, 3, 4, 5]
    assert [r["run/restarts"] for r in out] == [0, 0, 1, 1, 1]
    assert [r["train/policy_version"] for r in out] == [1, 2, 3, 4, 5]
    assert [r["rollout/actor_restarts"] for r in out] == [0, 0, 1, 1, 1], "the rebuild forgot the restart after step 2"
    assert [r["rollout/actors_alive"] for r in out] == [2, 2, 2, 2, 1]
    assert "rollout.max_actor_restarts=1 reached for this run; continuing on 1 actor(s)" in caplog.text
    state = store_state(CheckpointManager(cfg.run_dir).list()[-1])
    assert_each_prompt_once(state)
    assert len(state["trained"]) == len(set(state["trained"])) == 5 * cfg.rollout.batch_groups
    capsys.readouterr()

    cfg0 = make_cfg(tmp_path, *base, "run.max_restarts=0", name="no_restarts")

    def kill_at_2(step, batch, learner, pool):
        if step == 2:
            ray.kill(pool.store)

    with pytest.raises(RunStateLost, match="the rollout store died .*run.max_restarts=0 reached"):
        train(cfg0, on_step=kill_at_2)
    said = capsys.readouterr().err
    assert "run.resume=auto" in said and "step_00000001" in said and str(cfg0.run_dir) in said


# --------------------------------------------------------------------------- a signal while waiting
def test_a_signal_while_waiting_for_a_batch_abandons_the_wait_and_loses_nothing(cluster, tmp_path):
    """SIGINT/SIGTERM while the controller waits for a batch: the wait is cancelled without the store
    moving anything to `trained`, and the store keeps serving (what `run.resume` will find)."""
    import ray

    from actors.pool import ActorPool
    from async_april.data import PromptDataset, PromptRow
    from async_april.rollout.store_actor import RolloutStoreActor

    cfg = make_cfg(tmp_path, "rollout.batch_groups=2", "rollout.n_samples=2", "async.max_staleness=0",
                   "rollout.over_provision=1")
    rows = [PromptRow(prompt=str(i), answer=str(i), prompt_ids=np.array([1, 4 + i])) for i in range(8)]
    store = ray.remote(RolloutStoreActor).options(num_cpus=0).remote(cfg, PromptDataset(rows=rows, seed=0))
    pool = ActorPool(cfg, store, "unused")  # no generation actors: only a stop can end this wait
    polls = []

    def stop() -> bool:  # the signal arrives during the third poll of the wait
        polls.append(1)
        return len(polls) >= 3

    assert pool.wait_for_batch(poll_s=0.1, stop=stop) is None
    assert len(polls) == 3, "the wait went on polling after the stop"  # counted in polls, not seconds: load-proof
    work = ray.get(store.lease_async.remote("a", 4, 0))
    for s in work:
        s.extend(np.arange(2), -np.ones(2), np.zeros(2, np.int64), "stop")
        s.reward = 1.0
    ray.get(store.push_async.remote("a", work))
    assert ray.get(store.call.remote("accounting"))["trained"] == []  # the cancelled wait took nothing
    batch = pool.wait_for_batch(poll_s=0.1, stop=lambda: True)  # ready before the stop is looked at
    assert sorted(g.prompt_index for g in batch) == [0, 1]
    ray.get(store.call.remote("check_accounting"))


# --------------------------------------------------------------------------- resume: sync
@pytest.mark.slow
def test_sync_resume_from_step_k_equals_the_uninterrupted_run(cluster, tmp_path):
    """Sync preset, 3 steps with a checkpoint after each; then a new job resumes from the step-1
    checkpoint (what a job killed any time after step 1 finds) and runs steps 2-3."""
    sync = ["run.steps=3", "async.max_staleness=0", "rollout.over_provision=1", "rollout.early_stop=false",
            "rollout.on_weight_update=drain", "checkpoint.every=1", "checkpoint.keep=3"]
    final = {}
    cfg_a = make_cfg(tmp_path, *sync, name="a")
    train(cfg_a, on_step=lambda step, batch, learner: final.__setitem__("a", learner.full_state_dict()) if step == 3 else None)
    step1 = CheckpointManager(cfg_a.run_dir).path_for(1)
    cfg_b = make_cfg(tmp_path, *sync, f"run.resume={step1}", name="b")
    resumed_steps = []

    def on_step_b(step, batch, learner):
        resumed_steps.append(step)
        if step == 3:
            final["b"] = learner.full_state_dict()

    train(cfg_b, on_step=on_step_b)
    assert resumed_steps == [2, 3]
    for k, w in final["a"].items():
        torch.testing.assert_close(final["b"][k], w, atol=1e-5, rtol=0)
    ra, rb = rows(cfg_a), rows(cfg_b)
    for got, want in zip(rb, ra[1:]):
        assert got["train/step"] == want["train/step"]
        assert got["rollout/reward_mean"] == pytest.approx(want["rollout/reward_mean"], abs=1e-6)
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-5)
    def per_step(state):  # the batch is the B groups admitted for that version, in completion order
        t, b = state["trained"], cfg_a.rollout.batch_groups
        return [sorted(t[i:i + b]) for i in range(0, len(t), b)]

    assert per_step(store_state(CheckpointManager(cfg_b.run_dir).list()[-1])) == per_step(
        store_state(CheckpointManager(cfg_a.run_dir).list()[-1]))


# --------------------------------------------------------------------------- resume: async + truncated checkpoint
class Crash(RuntimeError):
    pass


def test_async_job_killed_then_resumed_from_a_truncated_checkpoint_loses_nothing(cluster, tmp_path, caplog):
    """Async preset (eta 2, interrupt): the job dies in step 3 (checkpoints 1 and 2 on disk);
    checkpoint 2 is then truncated. `run.resume=auto` must skip it with a warning naming both,
    resume from 1 (partials with their logprobs and versions), and finish with no prompt lost or
    trained twice; metrics.jsonl ends with one row per step (rows 2-3 of the dead job are redone),
    `time/elapsed_s` continues, and the W&B run is rewound to step 1 and continued."""
    from tests.wandb_records import read_offline_run

    cfg = make_cfg(tmp_path, "run.steps=5", "rollout.on_weight_update=interrupt", "rollout.concurrency=4",
                   "checkpoint.every=1", "checkpoint.keep=3", "logging.wandb=offline")

    def crash(step, batch, learner):
        if step == 3:
            raise Crash("simulated kill during step 3")

    with pytest.raises(Crash):
        train(cfg, on_step=crash)
    mgr = CheckpointManager(cfg.run_dir)
    assert [p.name for p in mgr.list()] == ["step_00000001", "step_00000002"]
    rows_before = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["train/step"] for r in rows_before] == [1, 2, 3]
    wandb_id = (cfg.run_dir / "wandb_run_id").read_text()
    at_ckpt1 = store_state(mgr.path_for(1))
    elapsed_at_1 = json.loads((mgr.path_for(1) / "controller.json").read_text())["time/elapsed_s"]
    victim = mgr.path_for(2) / "store.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated on disk

    batches = []
    cfg2 = make_cfg(tmp_path, "run.steps=5", "rollout.on_weight_update=interrupt", "rollout.concurrency=4",
                    "checkpoint.every=1", "checkpoint.keep=3", "logging.wandb=offline", "run.resume=auto")
    with caplog.at_level(logging.WARNING):
        train(cfg2, on_step=lambda step, batch, learner: batches.append((step, batch)))
    warning = " ".join(r.getMessage() for r in caplog.records if "step_00000002" in r.getMessage())
    assert "truncated" in warning and "step_00000001" in warning
    assert [s for s, _ in batches] == [2, 3, 4, 5]
    text = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert text[0] == rows_before[0], "the row of the checkpointed step was rewritten"
    got = [json.loads(line) for line in text]
    assert [r["train/step"] for r in got] == [1, 2, 3, 4, 5], "one row per step after the resume"
    elapsed = [r["time/elapsed_s"] for r in got]
    assert elapsed == sorted(elapsed) and elapsed[1] >= elapsed_at_1, "time/elapsed_s restarted at 0"
    assert (cfg.run_dir / "wandb_run_id").read_text() == wandb_id
    first, resumed = (read_offline_run(p) for p in sorted((cfg.run_dir / "wandb").glob("offline-run-*")))
    assert first.run_id == resumed.run_id == wandb_id and first.steps == [1, 2, 3]
    assert (resumed.branch_run, resumed.branch_step, resumed.steps) == (wandb_id, 1, [2, 3, 4, 5])
    final = store_state(mgr.list()[-1])
    assert_each_prompt_once(final)
    assert len(final["trained"]) == len(set(final["trained"])) == 5 * cfg.rollout.batch_groups
    assert final["trained"][: len(at_ckpt1["trained"])] == at_ckpt1["trained"]
    # Partials saved at checkpoint 1 were resumed, not regenerated: each trained response that
    # came from one starts with exactly the saved tokens, logprobs and versions.
    trained_rows = {}
    for _, b in batches:
        for i in range(len(b)):
            trained_rows.setdefault(b.input_ids[i][: b.prompt_lens[i]].tobytes(), []).append(
                (b.input_ids[i][b.prompt_lens[i]:], b.behavior_logprobs[i], b.versions[i]))
    resumed = 0
    for s in at_ckpt1["partials"].values():
        if s.prompt_index not in final["trained"]:
            continue
        cands = trained_rows[np.asarray(s.prompt_ids).tobytes()]
        n = s.num_tokens
        assert any(np.array_equal(ids[:n], s.response_ids) and np.array_equal(lp[:n], s.behavior_logprobs)
                   and np.array_equal(v[:n], s.versions) for ids, lp, v in cands), f"partial {s.uid} was not resumed"
        resumed += 1
    assert resumed > 0 or not at_ckpt1["partials"]
    assert all(r["staleness/max"] <= cfg.async_.max_staleness for r in rows(cfg))


# --------------------------------------------------------------------------- bad rewards
def test_reward_raising_with_on_error_stop_stops_with_its_message_and_keeps_output(cluster, tmp_path):
    from async_april.rewards.scoring import RewardError

    cfg = make_cfg(tmp_path, "run.steps=6", "reward.on_error=stop", "checkpoint.every=1", "async.max_staleness=0",
                   "rollout.over_provision=1")
    cfg.reward.functions = {"tests.fault_rewards:fails_after_40": 1.0}
    with pytest.raises(RewardError, match=r"fails_after_40.*reward.on_error=stop.*injected failure") as info:
        train(cfg)
    assert "ray" not in str(info.value).lower()
    got = rows(cfg)
    assert 1 <= len(got) < 6 and [r["train/step"] for r in got] == list(range(1, len(got) + 1))
    mgr = CheckpointManager(cfg.run_dir)
    assert mgr.latest_valid().step == len(got), "the checkpoint of the last finished step is intact"


CONFIG_SECRET = "cfgSECRETpw0123456789"
"""A password inside a config value of the W&B-offline run below."""


@pytest.fixture(scope="module")
def nan_reward_run(cluster, tmp_path_factory):
    """One W&B-offline run with fake API keys in the environment, a reward that returns NaN and one
    that hangs on its first call in each reward worker (reward.timeout_s); the learner's final weights are kept."""
    tmp = tmp_path_factory.mktemp("nanreward")
    fake = {"WANDB_API_KEY": "wandbFAKEKEY0123456789abcdef", "HF_TOKEN": "hf_FAKETOKEN0123456789",
            "MYSERVICE_API_KEY": "svcFAKEKEY987654321"}
    saved = {k: os.environ.get(k) for k in [*fake, "WANDB_DIR", "WANDB_MODE"]}
    os.environ.update(fake, WANDB_DIR=str(tmp))
    final = {}
    try:
        cfg = make_cfg(tmp, "run.steps=2", "logging.wandb=offline", "reward.on_error=zero", "reward.num_workers=2",
                       "reward.timeout_s=0.5", f"rollout.sglang.url=http://bob:{CONFIG_SECRET}@10.0.0.5:30000")  # unused by torch
        cfg.reward.functions = {"tests.fault_rewards:nan_every_fifth": 1.0, "tests.fault_rewards:hangs_on_its_first_call": 0.0}
        train(cfg, on_step=lambda step, batch, learner: final.update(learner.full_state_dict()))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return cfg, fake, final


def test_reward_nan_or_hanging_is_scored_zero_and_counted(nan_reward_run):
    cfg, _, _ = nan_reward_run
    got = rows(cfg)
    assert [r["train/step"] for r in got] == [1, 2]
    samples = 2 * cfg.rollout.batch_groups * cfg.rollout.n_samples
    # NaN every 5th sample of a worker, and the first call in each worker hangs (stopped after 0.5 s): the run went on
    assert got[-1]["rollout/reward_errors"] >= samples // 5 + 1
    assert all(np.isfinite(r["rollout/reward_mean"]) for r in got)


def test_run_checkpoint_loads_without_unpickling(nan_reward_run, no_pickle):
    """The run's checkpoint -- manifest, store, controller state and the learner's shards -- loads
    with every way of unpickling patched to fail, and restores the learner's exact weights."""
    from async_april.rollout.store import RolloutStore
    from learners.worker import LearnerWorker
    from tests.test_learner import free_port

    cfg, _, final = nan_reward_run
    model = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    worker = LearnerWorker(cfg, model, 0, 1, "127.0.0.1", free_port())
    ck = CheckpointManager(cfg.run_dir).latest_valid()
    assert ck.step == 2 and not list(ck.path.rglob("*.pkl")) and not list(ck.path.rglob("*.pt"))
    store = RolloutStore(cfg, None)
    store.load_state_dict(ck.store_state())
    store.check_accounting()
    assert len(store.trained) == 2 * cfg.rollout.batch_groups and ck.controller_state()["step"] == 2
    try:
        assert worker.load_checkpoint(str(ck.learner_dir)) == {"step": 2, "version": 2}
        got = worker.full_state_dict()
    finally:
        worker.shutdown()
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)


def test_api_keys_never_reach_the_run_directory(nan_reward_run):
    """Neither the fake API keys in the environment nor a password inside a config value (a URL with
    credentials) reach any file of a real W&B-offline run: config.yaml, metrics, checkpoints, W&B's files."""
    cfg, fake, _ = nan_reward_run
    files = [p for p in cfg.run_dir.rglob("*") if p.is_file()]
    assert any("offline-run" in str(p) for p in files), "W&B offline files were not written under the run dir"
    for p in files:
        data = p.read_bytes()
        for name, value in {**fake, "rollout.sglang.url's password": CONFIG_SECRET}.items():
            assert value.encode() not in data, f"{name} leaked into {p}"
    assert "http://bob:***@10.0.0.5:30000" in (cfg.run_dir / "config.yaml").read_text()


def test_ray_dashboard_is_off_and_sglang_binds_loopback(cluster):
    import ray

    from actors.engines.sglang_engine import SGLangEngine

    node = ray._private.worker.global_worker.node
    assert not node.address_info.get("webui_url"), "the embedded Ray dashboard must stay off"
    cmd = SGLangEngine("m").launch_command(30001)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


# --------------------------------------------------------------------------- NaN loss
def test_nan_loss_skips_the_step_without_broadcast_then_stops(cluster, tmp_path, monkeypatch):
    from learners.worker import INJECT_NAN_ENV

    monkeypatch.setenv(INJECT_NAN_ENV, "2,3")
    cfg = make_cfg(tmp_path, "run.steps=5", "learner.max_bad_steps=2", "checkpoint.every=1", "checkpoint.keep=5")
    versions = []
    with pytest.raises(RuntimeError, match=r"2 consecutive learner steps had a non-finite loss") as info:
        train(cfg, on_step=lambda step, batch, learner: versions.append(learner.version))
    assert "Traceback" not in str(info.value)
    got = rows(cfg)
    assert [r["train/step"] for r in got] == [1, 2]
    assert got[1]["train/bad_step"] == 1 and got[1]["train/bad_steps"] == 1
    assert got[1]["train/policy_version"] == 1 and versions == [1, 1]
    assert "timing_s/weight_sync" not in got[1], "a skipped step must not broadcast weights"
    assert got[1]["rollout/groups_skipped_bad_step"] == cfg.rollout.batch_groups
    mgr = CheckpointManager(cfg.run_dir)
    assert [mgr.verify(p).version for p in mgr.list()] == [1, 1]


# --------------------------------------------------------------------------- SGLang server down
def test_sglang_server_down_mid_run_returns_samples_and_recovers(cluster, tmp_path):
    """The SGLang client against the stand-in server; the server goes down after step 1, the
    actor's requests fail after the retry limit, its samples return to the store, and a replacement
    (once the server is back) loads the current weights and finishes the run."""
    import threading

    import ray

    from tests.sglang_standin import StandinServer

    cfg0 = make_cfg(tmp_path)
    model = str(resolve_model_path(cfg0.model.path, cfg0.model.cache_dir))
    srv = StandinServer(model, max_running=64)
    url = srv.start()
    port = srv.port
    while not srv.state.ready:  # transformers' lazy imports race across threads: let the stand-in load first
        time.sleep(0.05)
    cfg = make_cfg(tmp_path, "run.steps=3", "rollout.engine=sglang", f"rollout.sglang.url={url}",
                   "rollout.sglang.retries=1", "rollout.sglang.request_timeout_s=20", "rollout.max_actor_restarts=2",
                   "rollout.sglang.startup_timeout_s=60")  # a server that never comes back fails, not hangs
    servers = [srv]

    def on_step(step, batch, learner, pool):
        if step == 1:
            servers[0].stop()  # in-flight /generate calls fail: ServerDisconnected, then refused

            def bring_back_after_a_failure():
                # Back once the store has counted the actor's death (an event; a fixed 3 s delay let a
                # slow, loaded actor retry into the returned server and never fail).
                deadline = time.monotonic() + 120  # a failsafe only
                while ray.get(pool.store.call.remote("metrics"))["rollout/actor_failures"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                servers.append(StandinServer(model, port=port, max_running=64))
                servers[-1].start()

            threading.Thread(target=bring_back_after_a_failure, daemon=True).start()

    try:
        train(cfg, on_step=on_step)
    finally:
        for s in servers:
            s.stop()
    last = rows(cfg)[-1]
    assert last["train/step"] == 3 and last["rollout/actor_failures"] >= 1 and last["rollout/actor_restarts"] >= 1
    assert_each_prompt_once(store_state(CheckpointManager(cfg.run_dir).list()[-1]))


def test_two_sglang_actors_launch_servers_on_ports_of_their_own(cluster, tmp_path):
    """Two generation actors of one run each launch a server -- the SGLang stand-in, started as
    `python -m tests.sglang_standin` with SGLang's flags -- on a port of its own from
    rollout.sglang.port_range (the client as it was put every server on 30000), each checked to
    be the actor's own child."""
    import ray

    from actors.pool import ActorPool

    cfg = make_cfg(tmp_path, "rollout.engine=sglang", "rollout.num_actors=2", "rollout.sglang.launch_module=tests.sglang_standin",
                   "rollout.sglang.port_range=[31100, 31103]", "rollout.sglang.startup_timeout_s=120")
    pool = ActorPool(cfg, store=None, model_path=str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)))
    try:
        pool.start(2)
        notes = ray.get([a.startup_note.remote() for a in pool.handles])
    finally:
        pool.stop()
    ports = [int(re.search(r"127\.0\.0\.1:(\d+)", n)[1]) for n in notes]
    assert len(set(ports)) == 2 and all(31100 <= p <= 31103 for p in ports), notes


# --------------------------------------------------------------------------- invalid config
def test_invalid_config_fails_before_any_actor_starts(tmp_path):
    with pytest.raises(ConfigError, match="rollout.n_samples"):
        make_cfg(tmp_path, "rollout.n_samples=0")
    out = subprocess.run([sys.executable, "-m", "async_april.train", "configs/tiny_cpu.yaml", f"run.dir={tmp_path}/x",
                          "run.resume=/nonexistent/step_00000001"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "run.resume" in out.stderr
    assert not (tmp_path / "x").exists() and "ray" not in out.stderr.lower()
