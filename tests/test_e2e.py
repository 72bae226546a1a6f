"""The user's entry points, end to end: `async-april train` on the embedded cluster (W&B offline),
the APRIL preset's no-token-lost guarantee, and `ray job submit` against a local `ray start --head`."""

import json
import os
import socket
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
        [sys.executable, "-m", "async_april.cli", "train", str(config), f"run.dir={run_dir}", *SMALL, *overrides],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_run_from_the_cli_with_wandb_offline(tmp_path):
    proc, run_dir = train_cli(tmp_path, mode_config(tmp_path, "sync"), "run.steps=3", "logging.wandb=offline")
    rows = metrics(run_dir)
    assert [r["train/step"] for r in rows] == [1, 2, 3]
    assert [r["train/policy_version"] for r in rows] == [1, 2, 3]
    for key in REQUIRED_KEYS:
        assert all(key in r for r in rows), f"{key} missing from metrics.jsonl"
    assert all(r["staleness/max"] == 0 for r in rows)  # synchronous: every token on-policy
    assert all(r["rollout/tokens"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)
    saved = (run_dir / "config.yaml").read_text()
    assert "max_staleness: 0" in saved and "batch_groups: 4" in saved
    assert "[3/3] reward" in proc.stdout  # the one-line console summary
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run directory missing"


def test_april_preset_resumes_and_trains_every_aborted_token(tmp_path):
    _, run_dir = train_cli(tmp_path, mode_config(tmp_path, "april"), "run.steps=5", "rollout.max_new_tokens=48")
    rows = metrics(run_dir)
    last = rows[-1]
    assert last["rollout/aborted_tokens"] > 0, "early stop never aborted anything"
    assert last["rollout/aborted_tokens_reused"] > 0
    assert last["rollout/aborted_tokens_discarded"] == 0
    # every aborted token is either trained already or waiting (partial / resumed in flight)
    assert last["rollout/aborted_tokens"] == last["rollout/aborted_tokens_reused"] + last["rollout/aborted_tokens_pending"]
    assert max(r["staleness/max"] for r in rows) <= 4  # the preset's eta
    assert any(r["staleness/max"] >= 1 for r in rows), "no resumed prefix was trained"



def test_async_preset_never_exceeds_eta(tmp_path):
    _, run_dir = train_cli(tmp_path, mode_config(tmp_path, "async"), "run.steps=5", "async.max_staleness=1")
    rows = metrics(run_dir)
    assert max(r["staleness/max"] for r in rows) <= 1
    assert any(r["staleness/max"] == 1 for r in rows), "generation never ran ahead of the learner"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_against_a_local_head(tmp_path):
    """`ray start --head` on loopback with its own temp dir; `ray job submit` with token auth; stop only our processes."""
    temp_dir = Path("/tmp") / f"aa-ray-{os.getpid()}"  # short: Ray's socket paths have a length limit
    gcs_port, dash_port, agent_port, client_port = _free_port(), _free_port(), _free_port(), _free_port()
    env = {**cli_env(tmp_path), "RAY_TMPDIR": str(temp_dir)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={gcs_port}",
         f"--dashboard-port={dash_port}", "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1",
         # the job agent's default port (52365) is taken by any other Ray on the machine, even an embedded one
         f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
         "--num-cpus=4", f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{dash_port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", dash_port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        time.sleep(3)
        runtime_env = json.dumps({"working_dir": str(REPO), "excludes": [".git", ".venv", "runs", "benchmarks/results"]})
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", address,
               "--runtime-env-json", runtime_env, "--",
               "python", "-m", "async_april.train", "configs/tiny_cpu.yaml", f"run.dir={tmp_path}/jobrun", "run.steps=2", *SMALL]
        for _ in range(30):  # the dashboard answers before its job agent registers (slower on a loaded machine)
            submit = subprocess.run(cmd, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=400)
            out = submit.stdout + submit.stderr
            if "No available agent" not in out:
                break
            time.sleep(3)
        assert submit.returncode == 0 and "succeeded" in out, out[-5000:]
        assert "[2/2] reward" in out
        assert len(metrics(tmp_path / "jobrun")) == 2
    finally:
        _stop_our_cluster(head, temp_dir)


def _stop_our_cluster(head: subprocess.Popen, temp_dir: Path) -> None:
    """Ray's daemons re-parent away from `ray start`; find them by our private temp dir, never `ray stop`."""
    import psutil

    ours = [p for p in psutil.process_iter(["pid", "cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
    head.terminate()
    for p in ours:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(ours, timeout=15)
    for p in alive:
        p.kill()
    head.wait(timeout=15)
