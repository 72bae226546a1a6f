"""What a run shows and where it writes, without running one: progress bars and lines, the
end-of-run summary, metrics truncation on resume, and the run-directory rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_april.run import console
from async_april.run import directory as rundir
from async_april.config import load_config
from async_april.errors import RunDirError
from async_april.run.tracking import truncate_metrics


def rows(n: int, reward=lambda s: s / 10) -> list[dict]:
    return [{"train/step": s, "rollout/reward_mean": reward(s), "rollout/tokens": 100, "timing_s/step": 0.5,
             "time/elapsed_s": 10.0 * s} for s in range(1, n + 1)]


def test_without_a_terminal_each_step_is_one_line_with_its_eta(capsys):
    bar = console.TrainingProgress(total_steps=4, done_steps=1, console_every=1)  # resumed after step 1
    for r in rows(4)[1:]:
        bar.step(r)
    bar.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["[2/4]", "[3/4]", "[4/4]"]
    assert all(" | eta " in line for line in lines) and lines[-1].endswith("eta 0s")
    assert "reward 0.200" in lines[0] and err == ""


def test_in_a_terminal_training_draws_a_bar_with_eta(capsys, monkeypatch):
    monkeypatch.setattr(console, "interactive", lambda: True)
    bar = console.TrainingProgress(total_steps=3, done_steps=0, console_every=2)
    for r in rows(3):
        bar.step(r)
    bar.close()
    out, err = capsys.readouterr()
    assert "train:" in err and "3/3" in err and "<" in err and "reward 0.300" in err  # tqdm: elapsed<remaining
    assert [line.split()[0] for line in out.splitlines()] == ["[2/3]", "[3/3]"]  # every 2nd step, and the last


def test_stage_lines_off_a_terminal_and_a_bar_on_one(capsys, monkeypatch):
    monkeypatch.setattr(console, "NOTE_EVERY_S", 0.0)
    with console.stage("starting 2 sglang engine(s)", total=2, unit="engine") as s:
        s.set_postfix_str("SGLang at http://127.0.0.1:1: 12s of 600s (/health -> HTTP 503)")
        s.update(2)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[async-april] starting 2 sglang engine(s) (2 engines) ..."
    assert "0/2 engines" in err[1] and "HTTP 503" in err[1]
    assert err[2].startswith("[async-april] starting 2 sglang engine(s): done (2 engines) in ")
    monkeypatch.setattr(console, "interactive", lambda: True)
    with console.stage("tokenising d.jsonl", total=10, unit="row") as s:
        s.update(10)
    err = capsys.readouterr().err
    assert "tokenising d.jsonl:   0%|" in err and "0/10 [00:00<?, ?row/s]" in err and "done (10 rows)" in err


def test_run_summary_names_steps_reward_throughput_and_places():
    line = console.run_summary(rows(10), Path("/runs/x"), Path("/runs/x/checkpoints/step_00000010"))
    assert line == ("10 steps in 1m40s | reward 0.100 (first 10%) -> 0.950 (last 20%) | 200 trained tokens/s | "
                    "run dir /runs/x | last checkpoint /runs/x/checkpoints/step_00000010")
    assert console.run_summary([], Path("/r"), None) == "no step finished | run dir /r"


def test_resume_truncates_metrics_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = [json.dumps({"train/step": s, "v": s}) for s in (1, 2, 3, 2, 3, 4)] + ['{"train/step": 5, "v"']
    path.write_text("\n".join(text) + "\n")
    assert truncate_metrics(path, 3) == ["dropped 1 row(s) past step 3 (those steps are redone now)",
                                         "dropped 1 line(s) that are not JSON rows (cut short by the crash)",
                                         "kept the last of 5 rows for 3 steps"]
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["train/step"], r["v"]) for r in got] == [(1, 1), (2, 2), (3, 3)]  # one per step, the later row wins
    assert truncate_metrics(path, 3) == [] and not (tmp_path / "metrics.jsonl.tmp").exists()


def cfg_for(tmp_path, *over):
    return load_config(None, [f"run.dir={tmp_path}/run", *over])


@pytest.mark.parametrize("contents, used", [
    ({}, []),
    ({"config.yaml": "run: {}"}, []),  # a run that failed before its first step
    ({"config.yaml": "run: {}", "metrics.jsonl": "", "wandb/debug.log": "x", "checkpoints/.tmp-step_00000001/x": "x"}, []),
    ({"metrics.jsonl": '{"train/step": 1}\n'}, ["metrics.jsonl has 1 row"]),
    ({"checkpoints/step_00000002/manifest.json": "{}"}, ["checkpoint step_00000002"]),
    ({"notes.txt": "mine"}, ["files no run writes: notes.txt"]),
], ids=["empty", "config-only", "failed-before-step-1", "metrics", "checkpoint", "foreign-files"])
def test_what_counts_as_a_used_run_dir(tmp_path, contents, used):
    d = tmp_path / "run"
    d.mkdir()
    for rel, text in contents.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    state = rundir.inspect_run_dir(d)
    assert state.used == used
    if used:
        with pytest.raises(RunDirError, match="nothing was changed. Continue it with run.resume=auto"):
            rundir.check_reuse(state, cfg_for(tmp_path))
        rundir.check_reuse(state, cfg_for(tmp_path, "run.resume=auto"))
    else:
        rundir.check_reuse(state, cfg_for(tmp_path))


def test_overwrite_moves_the_old_run_aside_untouched(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000003").mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"train/step": 3}\n')
    state = rundir.inspect_run_dir(d)
    moved = rundir.prepare(state, cfg_for(tmp_path, "run.overwrite=true"))
    assert moved.parent == tmp_path and moved.name.startswith("run.old-")
    assert (moved / "metrics.jsonl").read_text() == '{"train/step": 3}\n' and (moved / "checkpoints" / "step_00000003").is_dir()
    assert d.is_dir() and not any(d.iterdir())


def test_relative_run_dir_is_absolute_here_and_an_error_under_a_ray_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.dir=runs/${name}"])
    assert rundir.absolute_run_dir(cfg) == tmp_path / "runs" / "tiny-reverse"
    monkeypatch.setenv(rundir.RAY_JOB_ENV, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}}))
    with pytest.raises(RunDirError, match="under `ray job submit`.*set run.dir to an absolute path on storage every node sees"):
        rundir.absolute_run_dir(cfg)
    assert rundir.absolute_run_dir(load_config(None, [f"run.dir={tmp_path}/abs"])) == tmp_path / "abs"


def test_signals_stop_start_up_at_once_and_the_step_loop_at_a_step_boundary(capsys):
    import os
    import signal

    from async_april.run.stopping import GracefulStop, Interrupted

    with pytest.raises(Interrupted, match="stopped by SIGTERM before a step finished; nothing new to save") as e:
        with GracefulStop():
            os.kill(os.getpid(), signal.SIGTERM)  # still starting: nothing to wait for
    assert e.value.exit_code == 143
    with GracefulStop() as stop:
        stop.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # `ray job stop` may repeat itself: ignored
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C aborts
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # handlers restored
    assert "SIGTERM: stopping after the current step and saving a checkpoint" in capsys.readouterr().err
    msg = str(Interrupted(signal.SIGINT, 7, Path("/r/checkpoints/step_00000007")))
    assert msg == ("stopped by SIGINT after step 7; checkpoint /r/checkpoints/step_00000007; "
                   "continue with the same command plus run.resume=auto")
