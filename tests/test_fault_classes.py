"""Faults of issue 31 found after start-up: two runs on one run directory, durability of metrics and
checkpoints, checkpoints from elsewhere naming files outside themselves, secrets in config values, a
reward that exits while scoring, weights that turn non-finite. One parametrised test per class, each
case failed on the code before the fix; the pieces (RunLock, Tracker, CheckpointManager, RewardScorer,
LearnerWorker) are called directly, and one slow test runs two real `async-april train` processes.
The bad input found before start-up is in tests/test_bad_input_classes.py.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from async_april.run.checkpoints import CheckpointError, CheckpointManager
from async_april.config import load_config
from tests.test_bad_input import TINY, jsonl, no_ray, run_cli, write  # noqa: F401 - no_ray is a fixture
from tests.agent_helpers import model_dir, tokenizer  # noqa: F401 - fixtures
from tests.test_bad_input_classes import assert_bounded_error

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


class FakeLearner:
    """What a learner checkpoint holds as far as the run checkpoint can tell: a safetensors shard and JSON."""

    def save_checkpoint(self, path):
        import numpy as np
        from safetensors.numpy import save_file

        Path(path).mkdir()
        save_file({"w": np.arange(64, dtype=np.float32)}, str(Path(path) / "rank0.safetensors"))
        (Path(path) / "learner.json").write_text('{"step": 1}')


def save(root: Path, step: int, controller: dict | None = None, verify: str = "sha256") -> Path:
    return CheckpointManager(root, keep=5, verify=verify).save(step, step, FakeLearner(), {"cursor": step},
                                                                {"step": step, **(controller or {})}, None, "h", {})


def hold_lock_in_a_process(run_dir: Path) -> subprocess.Popen:
    """A separate process that takes the run directory's lock and keeps it until killed."""
    code = ("import sys, time; from async_april.run.lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ------------------------------------------------------------------ two runs, one run directory

def lock_here(run: Path):
    from async_april.run.lock import RunLock

    return RunLock(run).acquire(), os.getpid()


def lock_elsewhere(run: Path):
    proc = hold_lock_in_a_process(run)
    return proc, proc.pid


def used(run: Path) -> Path:
    jsonl(run / "metrics.jsonl", [{"train/step": 1}])
    write(run / "config.yaml", "run: {}\n")
    return run


LOCK_CASES = [
    ("fresh-run-while-this-process-holds-it", lock_here, lambda run: []),
    ("fresh-run-while-another-process-holds-it", lock_elsewhere, lambda run: []),
    ("resume-while-another-run-holds-it", lock_elsewhere, lambda run: ["run.resume=auto"]),
    ("overwrite-while-another-run-holds-it", lambda run: lock_elsewhere(used(run)), lambda run: ["run.overwrite=true"]),
]


@pytest.mark.parametrize("case, holder, over", LOCK_CASES, ids=[c[0] for c in LOCK_CASES])
def test_a_second_run_on_a_locked_run_dir_exits_2_and_changes_nothing(case, holder, over, tmp_path, capsys, monkeypatch, no_ray):
    run = tmp_path / "run"
    held, pid = holder(run)
    try:
        before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}
        rc, _, err = run_cli(["train", "CFG", *over(run), "data.num_prompts=64"], capsys, monkeypatch, tmp_path)
        assert_bounded_error(rc, err, rf"run\.dir {re.escape(str(run))} is in use by another run \(pid {pid} on [^,]+, "
                                      r"started .* UTC\); nothing was changed\. Wait for it to finish, or give this run another run\.name")
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()} == before
        assert not list(tmp_path.glob("*.old-*"))
    finally:
        held.kill() if isinstance(held, subprocess.Popen) else held.release()


def test_a_stale_lock_of_a_killed_run_is_taken_over_and_said(tmp_path):
    from async_april.run.lock import RunLock

    proc = hold_lock_in_a_process(tmp_path)
    with pytest.raises(Exception, match=rf"in use by another run \(pid {proc.pid} "):
        RunLock(tmp_path).acquire()
    proc.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops a flock with its process
    proc.wait()
    lock = RunLock(tmp_path).acquire()
    try:
        assert lock.stale_note() == f"run.dir {tmp_path}: took over a stale lock of pid {proc.pid} on {os.uname().nodename} (no longer running)"
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    with RunLock(tmp_path) as again:  # released: the next run takes it, and it is not stale (it was ours)
        assert again.stale_note() is None


# ------------------------------------------------------------------ durability

def tracker_for(run_dir: Path, **kw):
    from async_april.run.tracking import Tracker

    cfg = load_config(None, [f"run.dir={run_dir}", "logging.console_every=100"])
    return Tracker(cfg, run_dir, **kw)


def logged_rows(run_dir: Path, steps) -> list[dict]:
    t = tracker_for(run_dir)
    rows = [t.log({"train/step": s, "rollout/reward_mean": s / 10}) for s in steps]
    t.close()
    return rows


def case_torn_last_row_comes_back_from_its_checkpoint(tmp_path, capsys):
    rows = logged_rows(tmp_path, (1, 2, 3))
    ck = save(tmp_path, 3, {"metrics_row": rows[-1]})  # what RunState.save keeps: the row of its step
    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text[: len(text) - 25])  # power loss mid-row 3
    tracker_for(tmp_path, resume_step=3, checkpoint_row=CheckpointManager(tmp_path).verify(ck).controller_state()["metrics_row"]).close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows  # one row per step, exact
    err = capsys.readouterr().err
    assert ("metrics.jsonl, resuming from step 3: dropped 1 line(s) that are not JSON rows (cut short by the crash); "
            "restored the row of step 3 from its checkpoint (it was lost or torn in the file)") in err
    assert "redone" not in err  # nothing past step 3 existed: saying steps are redone would be untrue


def case_a_lost_row_without_a_copy_is_said_plainly(tmp_path, capsys):
    logged_rows(tmp_path, (1, 2))
    tracker_for(tmp_path, resume_step=3).close()  # a checkpoint of step 3 from before rows were kept in it
    assert [json.loads(x)["train/step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "the row of step 3 is missing and its checkpoint holds no copy: that step stays without a row" in capsys.readouterr().err


def case_rows_whose_step_is_not_an_integer(tmp_path, capsys):
    jsonl(tmp_path / "metrics.jsonl", [{"train/step": 1}, {"train/step": "two"}, {"train/step": None}, {"train/step": 2.5},
                                       {"train/step": [2]}, {"train/step": True}, {"no_step": 1}, {"train/step": 2.0}])
    tracker_for(tmp_path, resume_step=2).close()
    assert [json.loads(x)["train/step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2.0]
    assert "dropped 6 row(s) whose train/step is not an integer" in capsys.readouterr().err


def case_a_metrics_line_nested_too_deep(tmp_path, capsys):
    jsonl(tmp_path / "metrics.jsonl", [{"train/step": 1}, '{"train/step": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    tracker_for(tmp_path, resume_step=1).close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"train/step": 1}]
    assert "dropped 1 line(s) that are not JSON rows" in capsys.readouterr().err


def case_the_row_is_fsynced_before_its_checkpoint_commits(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, target: (events.append(("rename", str(self))), real_rename(self, target))[1])
    t = tracker_for(tmp_path)
    t.log({"train/step": 1})
    save(tmp_path, 1, {"metrics_row": t.last_row})
    t.close()
    commit = events.index(("rename", str(tmp_path / "checkpoints" / ".tmp-step_00000001")))
    assert ("fsync", str(tmp_path / "metrics.jsonl")) in events[:commit], "the row of step 1 was not on disk before its checkpoint"


def _corrupt_header(ck: Path) -> None:
    p = ck / "store.safetensors"
    data = bytearray(p.read_bytes())
    data[:8] = b"\xff" * 8  # same size: only reading the header can tell
    p.write_bytes(bytes(data))


def _corrupt_json(ck: Path) -> None:
    p = ck / "controller.json"
    p.write_text("x" * p.stat().st_size)


def _fallback_with_size_verify(corrupt):
    def case(tmp_path, caplog):
        save(tmp_path, 1, verify="size")
        bad = save(tmp_path, 2, verify="size")
        corrupt(bad)
        with caplog.at_level(logging.WARNING):
            ck = CheckpointManager(tmp_path, verify="size").latest_valid()
        assert ck is not None and ck.step == 1, "did not fall back to the previous checkpoint"
        assert f"skipping invalid checkpoint(s): {bad}: " in caplog.text and "is unreadable" in caplog.text
    return case


def case_a_named_checkpoint_that_cannot_be_read_falls_back(tmp_path, caplog):
    from async_april.run.checkpoints import resolve_resume

    save(tmp_path, 1)
    bad = save(tmp_path, 2)
    _corrupt_header(bad)
    cfg = load_config(None, [f"run.dir={tmp_path}", f"run.resume={bad}", "checkpoint.verify=size"])
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(cfg, tmp_path).step == 1
    assert "using the previous valid checkpoint" in caplog.text


DURABILITY = {
    "torn-last-row-and-a-checkpoint-of-its-step": case_torn_last_row_comes_back_from_its_checkpoint,
    "lost-row-without-a-copy-said-plainly": case_a_lost_row_without_a_copy_is_said_plainly,
    "rows-with-a-non-integer-step": case_rows_whose_step_is_not_an_integer,
    "metrics-line-nested-too-deep": case_a_metrics_line_nested_too_deep,
    "row-fsynced-before-its-checkpoint-commits": case_the_row_is_fsynced_before_its_checkpoint_commits,
    "verify-size-corrupt-shard-header": _fallback_with_size_verify(_corrupt_header),
    "verify-size-corrupt-json-file": _fallback_with_size_verify(_corrupt_json),
    "named-checkpoint-unreadable-falls-back": case_a_named_checkpoint_that_cannot_be_read_falls_back,
}


@pytest.mark.parametrize("case", DURABILITY)
def test_durability_of_metrics_and_checkpoints(case, request, tmp_path):
    fn = DURABILITY[case]
    import inspect

    fixtures = {name: request.getfixturevalue(name) for name in inspect.signature(fn).parameters if name != "tmp_path"}
    fn(tmp_path, **fixtures)


# ------------------------------------------------------------------ checkpoints from elsewhere

def manifest_naming(ck: Path, rel: str) -> None:
    m = json.loads((ck / "manifest.json").read_text())
    m["files"][rel] = {"bytes": 7}
    (ck / "manifest.json").write_text(json.dumps(m))


def _symlink_out(ck: Path, target: Path) -> str:
    (ck / "leak.bin").symlink_to(target)
    return "leak.bin"


CONFINEMENT = [
    ("relative-escape", lambda ck, target: "../../../secret.txt", r"names '\.\./\.\./\.\./secret\.txt', which is not a relative path inside"),
    ("absolute-path", lambda ck, target: str(target), r"names '/.*secret\.txt', which is not a relative path inside the checkpoint"),
    ("escape-through-a-subdirectory", lambda ck, target: "learner/../../../../secret.txt", r"which is not a relative path inside"),
    ("symlink-to-outside", _symlink_out, r"names 'leak\.bin', which goes through a symbolic link"),
]


@pytest.mark.parametrize("case, entry, pattern", CONFINEMENT, ids=[c[0] for c in CONFINEMENT])
def test_a_manifest_path_outside_the_checkpoint_is_refused_without_reading_it(case, entry, pattern, tmp_path, monkeypatch):
    target = write(tmp_path / "secret.txt", "hunter2")  # 7 bytes, as the manifest claims: a size oracle otherwise
    ck = save(tmp_path / "run", 1)
    manifest_naming(ck, entry(ck, target))
    touched: list[str] = []
    real_stat, real_open = os.stat, io.open

    def stat(path, *a, follow_symlinks=True, **k):  # lstat (follow_symlinks=False) reads the link, not its target
        if follow_symlinks:
            touched.append(os.path.realpath(path))
        return real_stat(path, *a, follow_symlinks=follow_symlinks, **k)

    def opened(path, *a, **k):
        touched.append(os.path.realpath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(io, "open", opened)
    monkeypatch.setattr(builtins, "open", opened)
    with pytest.raises(CheckpointError, match=pattern + r".*refused without reading it"):
        CheckpointManager(tmp_path / "run").verify(ck)
    assert str(target) not in touched, "the file outside the checkpoint was opened or stat'ed"


# ------------------------------------------------------------------ secrets in config values

SECRET = "pw-hunter2-0123456789"


def test_a_secret_in_a_config_value_reaches_no_file_under_run_dir(tmp_path, monkeypatch):
    """config.yaml and W&B's offline run (its config, its files) hold the config with the URL password
    and the flag's value masked; metrics rows too. Run by the real Tracker with W&B offline."""
    from async_april.config import save_config
    from async_april.run.tracking import Tracker

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(TINY, [f"run.dir={tmp_path}/run", "logging.wandb=offline",
                             f"rollout.sglang.url=http://bob:{SECRET}@10.0.0.5:30000",
                             f"rollout.sglang.extra_args=['--api-key', '{SECRET}x']"])
    run_dir = cfg.run_dir
    save_config(cfg, run_dir)
    t = Tracker(cfg, run_dir)
    t.log({"train/step": 1, "rollout/reward_mean": 0.5, "note": f"server http://bob:{SECRET}@10.0.0.5:30000"})
    t.close()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any("offline-run" in str(p) for p in files), "W&B offline files were not written under the run dir"
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, f"the secret reached {leaked}"
    assert "http://bob:***@10.0.0.5:30000" in (run_dir / "config.yaml").read_text()
    assert cfg.rollout.sglang.url == f"http://bob:{SECRET}@10.0.0.5:30000", "the config in memory keeps the real URL"


# ------------------------------------------------------------------ a reward that exits while scoring

EXIT_WHILE_SCORING = [
    ("inline-on-error-zero", {"on_error": "zero"}, None),
    ("inline-on-error-stop", {"on_error": "stop"}, r"reward 'tests\.fault_rewards:calls_sys_exit' failed and reward\.on_error=stop: "
                                                   r"reward 'tests\.fault_rewards:calls_sys_exit' called sys\.exit\(4\)"),
    ("in-a-reward-worker", {"on_error": "zero", "num_workers": 1}, None),
]


@pytest.mark.parametrize("case, settings, stops", EXIT_WHILE_SCORING, ids=[c[0] for c in EXIT_WHILE_SCORING])
def test_a_reward_that_calls_sys_exit_while_scoring_is_contained_like_one_that_raises(case, settings, stops):
    from async_april.config import RewardConfig
    from async_april.rewards.scoring import RewardError, RewardScorer

    scorer = RewardScorer(RewardConfig(functions={"tests.fault_rewards:calls_sys_exit": 1.0, "reverse_match": 1.0}, **settings))
    try:
        if stops:
            with pytest.raises(RewardError, match=stops):
                scorer.score("12=", "21", "21")
            return
        total, parts = scorer.score("12=", "21", "21")
        assert parts == {"tests.fault_rewards:calls_sys_exit": 0.0, "reverse_match": 1.0} and total == 1.0
        assert scorer.errors == 1
        assert scorer.score("34=", "43", "43")[0] == 1.0, "the scorer (and its worker) went on after the exit"
    finally:
        scorer.close()


# ------------------------------------------------------------------ weights that turn non-finite

def test_weights_that_turn_non_finite_stop_the_learner_before_anything_is_saved(tmp_path):
    """A step whose loss and gradient are finite but whose optimizer update makes the weights
    non-finite (a weight decay the schema would refuse, forced here past it) raises a UserError
    naming the optimizer keys, before the version moves: nothing is broadcast or saved after it."""
    from async_april.errors import UserError, WeightsDivergedError
    from tests.test_learner import local_worker, make_batch, make_cfg

    model = tmp_path / "m"
    from async_april.models import build_random_tiny_model

    build_random_tiny_model(model, seed=0, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1)
    cfg = make_cfg(lr=1e-3, warmup_steps=0)  # warm-up would make the first step's lr 0
    object.__setattr__(cfg.learner, "weight_decay", 1e42)  # past validation: what the guard is for
    with local_worker(cfg, str(model)) as w:
        with pytest.raises(WeightsDivergedError, match=r"learner step 1 made the weights non-finite \(NaN/inf\) in the "
                           r"optimizer step, with a finite loss .* learner\.weight_decay=1e\+42.*stopped before saving or "
                           r"broadcasting them, the last checkpoint is intact") as info:
            w.train_step(make_batch(str(model), seed=1))
        assert isinstance(info.value, UserError) and w.version == 0, "the version moved: the weights would be broadcast"


def test_an_environment_step_that_calls_sys_exit_is_a_step_failure_like_one_that_raises(model_dir, tokenizer):
    """`rollout.env` code that calls sys.exit in a step goes to the environment's on_failure and is
    counted, as a step that raises does; the episode ends and the generation actor goes on."""
    import asyncio

    from tests.agent_envs import ExitingEnv
    from tests.agent_helpers import make_actor, make_cfg, run_episode, turn_rows

    ExitingEnv.errors.clear()
    actor = make_actor(make_cfg(model_dir, "tests.agent_envs:ExitingEnv", "rollout.agent.max_turns=4"), model_dir)
    s = asyncio.run(run_episode(actor, turn_rows(tokenizer, 4, seed=4)[0]))
    assert ExitingEnv.errors == ["called sys.exit(5)"] and actor.agent.metrics()["agent/step_failures"] == 1
    assert s.turns == 2
