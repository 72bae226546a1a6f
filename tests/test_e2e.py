"""The user's entry points, end to end: `async-april train` on the embedded cluster (W&B offline),
the APRIL preset's no-token-lost guarantee, and `ray job submit` against a local `ray start --head`."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
SMALL = ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.max_new_tokens=32", "rollout.concurrency=16"]
REQUIRED_KEYS = [
    "train/step", "train/policy_version", "rollout/reward_mean", "rollout/response_len_mean", "rollout/tokens",
    "perf/rollout_tokens_per_s", "timing_s/rollout", "timing_s/train", "timing_s/weight_sync", "loss/policy",
    "staleness/max", "staleness/mean", "perf/engine_idle_frac", "rollout/inflight", "rollout/partial_resumed",
    "rollout/aborted_tokens_reused", "rollout/groups_filtered", "is/weight_mean", "loss/clip_frac", "reward/reverse_match",
    "perf/engine_batch_occupancy", "perf/engine_kv_pad_frac", "async/eta", "mismatch/k1", "mismatch/k3", "mismatch/ess",
    "mismatch/k3_lag0", "mismatch/ess_lag0", "is/rejected_frac", "async/over_provision",
]


def mode_config(tmp_path: Path, preset: str) -> Path:
    """A config that layers a mode preset over the tiny CPU config (presets are data, not code paths)."""
    path = tmp_path / f"{preset}.yaml"
    path.write_text(f"defaults:\n  - {REPO}/configs/tiny_cpu.yaml\n  - {REPO}/configs/presets/{preset}.yaml\n")
    return path


def cli_env(tmp_path: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
            "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}


def train_cli(tmp_path: Path, config: Path, *overrides: str, timeout: int = 400) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "async_april.launch.cli", "train", str(config), f"run.dir={run_dir}", *SMALL, *overrides],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sync_cli_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync")
    config = mode_config(tmp, "sync")
    proc, run_dir = train_cli(tmp, config, "run.steps=3", "logging.wandb=offline")
    return proc, run_dir, config, tmp


def test_sync_run_from_the_cli_with_wandb_offline(sync_cli_run):
    proc, run_dir, _, _ = sync_cli_run
    rows = metrics(run_dir)
    assert [r["train/step"] for r in rows] == [1, 2, 3]
    assert [r["train/policy_version"] for r in rows] == [1, 2, 3]
    for key in REQUIRED_KEYS:
        assert all(key in r for r in rows), f"{key} missing from metrics.jsonl"
    assert all(r["staleness/max"] == 0 for r in rows)  # synchronous: every token on-policy
    # ... so the mismatch is the torch engine's numerics against the learner's (both fp32 here): tiny
    assert all(r["mismatch/token_frac_lag0"] == 1.0 and r["mismatch/k3_lag0"] < 1e-6 and r["mismatch/ess_lag0"] > 0.9999
               for r in rows), [(r["mismatch/k3_lag0"], r["mismatch/ess_lag0"]) for r in rows]
    assert all(r["async/eta"] == 0 and r["async/over_provision"] == 1.0 for r in rows)
    assert all(0.0 <= r["perf/engine_kv_pad_frac"] < 1.0 for r in rows) and any(r["perf/engine_kv_pad_frac"] > 0 for r in rows)
    assert all(r["rollout/tokens"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)
    saved = (run_dir / "config.yaml").read_text()
    assert "max_staleness: 0" in saved and "batch_groups: 4" in saved
    # Not a terminal: exactly one line per step (with its ETA), then the summary and where things are.
    assert [line.split(" reward ")[0] for line in proc.stdout.splitlines()] == ["[1/3]", "[2/3]", "[3/3]"]
    assert all(" | eta " in line for line in proc.stdout.splitlines())
    assert f"run dir {run_dir} (new)" in proc.stderr
    assert re.search(rf"3 steps in \S+ \| reward [\d.]+ \(first 10%\) -> [\d.]+ \(last 20%\) \| [\d,]+ trained tokens/s \| "
                     rf"run dir {run_dir} \| last checkpoint {run_dir}/checkpoints/step_00000003", proc.stderr)
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run directory missing"


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_fresh_run_in_a_used_run_dir_is_refused_and_changes_nothing(sync_cli_run):
    _, run_dir, config, tmp = sync_cli_run
    before = snapshot(run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "async_april.launch.cli", "train", str(config), f"run.dir={run_dir}", *SMALL, "run.steps=3"],
        cwd=REPO, env=cli_env(tmp), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(rf"^error: run.dir {run_dir} already holds a run \(metrics.jsonl has 3 rows; checkpoint "
                     r"step_00000003\); nothing was changed. Continue it with run.resume=auto, start another with a new "
                     r"run.name \(or run.dir\), or replace it with run.overwrite=true", proc.stderr, re.M), proc.stderr
    assert "Started a local Ray instance" not in proc.stderr
    assert snapshot(run_dir) == before, "the refused run touched the old run's files"


@pytest.fixture(scope="module")
def async_run_stopped_by_sigterm(tmp_path_factory):
    """The async preset (eta 1) from the real CLI; SIGTERM once step 5 is logged; then a second
    process continues it with `run.resume=auto` for two more steps. While the first is starting
    (it holds the run directory's lock), the same fresh command is run once more: it must exit 2."""
    tmp = tmp_path_factory.mktemp("async")
    run_dir, config = tmp / "run", mode_config(tmp, "async")
    cmd = [sys.executable, "-m", "async_april.launch.cli", "train", str(config), f"run.dir={run_dir}", *SMALL,
           "async.max_staleness=1", "run.steps=40"]
    with open(tmp / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(tmp), stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + 120
        while not (run_dir / "run.lock").is_file() or str(proc.pid) not in (run_dir / "run.lock").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.1)
        second = subprocess.run(cmd, cwd=REPO, env=cli_env(tmp), capture_output=True, text=True, timeout=180, check=False)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[5/40]"):
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    stderr = (tmp / "stderr.txt").read_text()
    stop = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+); continue with the same command plus "
                     r"run.resume=auto", stderr)
    assert rc == 128 + signal.SIGTERM and stop and "Traceback" not in stderr, stderr[-3000:]
    k, ckpt = int(stop.group(1)), Path(stop.group(2))
    resumed, _ = train_cli(tmp, config, "async.max_staleness=1", "run.resume=auto", f"run.steps={k + 2}")
    return dict(run_dir=run_dir, lines=lines, k=k, ckpt=ckpt, resumed=resumed, second=second, first_pid=proc.pid)


def test_sigterm_mid_run_saves_a_checkpoint_that_resumes(async_run_stopped_by_sigterm):
    """A real `async-april train` process gets SIGTERM: it finishes the step, saves a checkpoint,
    stops, names the checkpoint and how to resume, and exits 143; `run.resume=auto` then continues
    from it, leaving one metrics row per step."""
    r = async_run_stopped_by_sigterm
    run_dir, k, ckpt = r["run_dir"], r["k"], r["ckpt"]
    assert 5 <= k < 40 and ckpt == run_dir / "checkpoints" / f"step_{k:08d}"
    assert [line.split()[0] for line in r["lines"]] == [f"[{s}/40]" for s in range(1, k + 1)]
    assert r["resumed"].stdout.splitlines()[0].startswith(f"[{k + 1}/{k + 2}]")
    assert f"resume from {ckpt} (step {k}" in r["resumed"].stderr
    assert [row["train/step"] for row in metrics(run_dir)] == list(range(1, k + 3))


def test_a_second_fresh_run_started_while_the_first_runs_exits_2(async_run_stopped_by_sigterm):
    """Two fresh runs on one run.dir at once: the second exits 2 before starting Ray -- at the run
    directory's lock, or, if the first already finished a step by then, at the used-directory check --
    and the first's files are its own: one metrics row per step (the SIGTERM test above)."""
    r = async_run_stopped_by_sigterm
    second = r["second"]
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and (f"is in use by another run (pid {r['first_pid']} " in errors[0]
                                 or "already holds a run" in errors[0]), second.stderr[-3000:]
    assert "Started a local Ray instance" not in second.stderr + second.stdout


def test_april_preset_resumes_and_trains_every_aborted_token(tmp_path):
    """APRIL's promise over a run long enough for partials to reach eta: with eta 1 (the preset's 4
    takes ~40 steps to get there) partials cut by two early stops are due, and were regenerated
    from scratch before batches waited for due groups (52 aborted tokens discarded by step 4)."""
    _, run_dir = train_cli(tmp_path, mode_config(tmp_path, "april"), "run.steps=8", "async.max_staleness=1")
    rows = metrics(run_dir)
    last = rows[-1]
    assert last["rollout/aborted_tokens"] > 0, "early stop never aborted anything"
    assert last["rollout/aborted_tokens_reused"] > 0
    assert last["rollout/aborted_tokens_discarded"] == 0 and last["rollout/wasted_tokens"] == 0
    assert last["rollout/groups_requeued_stale"] == 0
    # every aborted token is either trained already or waiting (partial / resumed in flight)
    assert last["rollout/aborted_tokens"] == last["rollout/aborted_tokens_reused"] + last["rollout/aborted_tokens_pending"]
    assert max(r["staleness/max"] for r in rows) <= 1
    assert sum(r["staleness/max"] == 1 for r in rows) >= 3, "staleness never built up to eta"



def test_auto_eta_raises_while_generation_is_the_bottleneck_and_admission_follows(tmp_path):
    """`async.max_staleness: auto` with a budget that always holds and a zero wait threshold: eta goes
    up to `async.auto.max`, each raise once the eta in force had eta + 1 steps, every change is logged, and no token ever lags more than
    the eta in force when its group was admitted (the store checks its accounting every step)."""
    proc, run_dir = train_cli(tmp_path, mode_config(tmp_path, "async"), "run.steps=3", "async.max_staleness=auto",
                              "async.auto.max=2", "async.auto.min_ess=0.01", "async.auto.raise_wait_frac=0",
                              "async.auto.raise_after=1")
    rows = metrics(run_dir)
    assert [r["async/eta"] for r in rows] == [1, 1, 2]  # the eta decided after each step (eta 1: 2 steps to judge it)
    assert [r["async/eta_change"] for r in rows] == [1, 0, 1]
    assert "auto: raise eta 0 -> 1" in proc.stderr and "auto: raise eta 1 -> 2" in proc.stderr
    assert rows[0]["staleness/max"] == 0  # step 1's groups were admitted at eta 0
    assert max(r["staleness/max"] for r in rows) <= 2
    assert all(0 < r["mismatch/ess"] <= 1 + 1e-6 for r in rows)  # <= 1 by Cauchy-Schwarz, up to float rounding
    from async_april.rollout.auto_staleness import TunerState
    from async_april.run.checkpoints import CheckpointManager

    saved = CheckpointManager(run_dir).latest_valid().controller_state()["async/tuner"]  # what a resume restores
    assert TunerState.from_dict(saved) == TunerState(seen=True)  # raised after step 3: window and calm start again


def test_async_preset_never_exceeds_eta(async_run_stopped_by_sigterm):
    rows = metrics(async_run_stopped_by_sigterm["run_dir"])
    assert max(r["staleness/max"] for r in rows) <= 1
    assert any(r["staleness/max"] == 1 for r in rows), "generation never ran ahead of the learner"
