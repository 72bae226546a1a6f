"""The capacity planner (`async-april plan`): its model, its simulation, its table and its errors."""

from __future__ import annotations

import json
import math

import pytest

from async_april.config import load_config
from async_april.errors import UserError
from async_april.launch.cli import main as cli_main
from async_april.planning.simulator import engine_ceiling, simulate
from async_april.planning.planner import (
    COLUMNS,
    TIE,
    LearnerModel,
    Row,
    Setting,
    ceiling,
    grid,
    recommend,
    splits,
)

TINY = "configs/tiny_cpu.yaml"


def test_ceiling_is_sum_over_max():
    assert ceiling(3.0, 1.0) == pytest.approx(4 / 3)
    assert ceiling(2.0, 2.0) == pytest.approx(2.0)
    assert ceiling(0.0, 5.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ceiling(0.0, 0.0)


def test_learner_model_is_six_params_tokens_over_flops():
    m = LearnerModel(4e9, peak_flops=1e15, mfu=0.5)
    assert m.step_s(1_000_000, gpus=2) == pytest.approx(6 * 4e9 * 1e6 / (2 * 1e15 * 0.5))
    with pytest.raises(UserError, match="MFU"):
        LearnerModel(1e9, mfu=1.5)


def test_learner_cost_counts_frozen_params_and_extra_forwards():
    """Issue 38: 6 x trained params per token, + 4 x frozen (a LoRA base: forward and input gradients), + 2 x
    all params per no-grad forward beside the training one; the tokens are the rows' prompt + response."""
    m = LearnerModel(4e9, peak_flops=1e15, mfu=0.5, frozen=1e9, extra_forwards=2)
    assert m.flops_per_token == 6 * 4e9 + 4 * 1e9 + 2 * 5e9 * 2
    assert m.step_s(1000, gpus=2) == pytest.approx(1000 * m.flops_per_token / (2 * 1e15 * 0.5))
    assert "2 x 5e+09 x 2 extra forward(s)" in m.describe() and "4 x 1e+09 frozen" in m.describe()


@pytest.mark.parametrize("over, extra", [
    ([], 0),
    (["algorithm.correction=decoupled"], 0),  # one mini-batch: the training forward's own values are pi_prox
    (["algorithm.correction=decoupled", "learner.mini_batches=2"], 1),  # a proximal forward before the first update
    (["algorithm.kl_coef=0.1"], 1),  # the reference model's forward
    (["algorithm.correction=decoupled", "learner.mini_batches=2", "algorithm.kl_coef=0.1"], 2),
])
def test_extra_forwards_come_from_the_config(over, extra):
    from async_april.launch.plan_command import extra_forwards

    assert extra_forwards(load_config(TINY, over)) == extra


def test_splits_and_grid():
    assert splits(2, 1) == [(1, 1)]
    assert splits(8, 2) == [(2, 6), (4, 4), (6, 2)]
    assert len(splits(64, 1)) == 4 and splits(64, 1)[0] == (1, 63) and splits(64, 1)[-1] == (63, 1)
    with pytest.raises(UserError, match="--gpus"):
        splits(0, 1)
    with pytest.raises(UserError, match="no split"):
        splits(2, 2)
    modes = [s.mode for s in grid(2, 1)]
    assert modes.count("sync") == 1 and modes.count("april") >= 2 and modes.count("async") >= 4


def _row(tps: float, stale: float, eta: int = 1) -> Row:
    return Row(Setting("async", 1, 1, eta, eta + 1.0), tps, 0.5, stale, eta, 0.0, 1.0, 1.0)


def test_recommend_is_the_best_row_least_stale_among_equals():
    rows = [_row(100.0, 0.5), _row(120.0, 2.0, 2), _row(120.0 * (1 - TIE / 2), 1.0, 4), _row(90.0, 0.0)]
    assert recommend(rows) is rows[2]  # within TIE of the best and less stale
    rows = [_row(100.0, 0.5), _row(130.0, 3.0, 4), _row(120.0, 1.0, 2)]
    assert recommend(rows) is rows[1]


def _cfg(*over: str):
    return load_config(TINY, ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.concurrency=16", *over])


def _const(n: int):
    return lambda rng: n


def test_sync_simulation_matches_the_analytic_step():
    """Constant lengths L and a constant decode step a: a sync step is L * a to generate, the
    learner's time, and the weight load, one after the other; async overlaps them."""
    L, a, train, update = 40, 0.01, 0.7, 0.05
    step = lambda b, t, p: a
    kw = {"steps": 8, "engines": 1, "step_s": step, "update_s": update, "train_s": lambda n: train, "sample_length": _const(L), "prompt_tokens": 8}
    tokens = 4 * 4 * L
    sync = simulate(_cfg("async.max_staleness=0", "rollout.over_provision=1"), **kw)
    assert sync.useful_tokens_per_s(2) == pytest.approx(tokens / (L * a + train + update), rel=1e-6)
    assert sync.staleness_max == 0
    asyn = simulate(_cfg("async.max_staleness=2", "rollout.over_provision=3", "rollout.on_weight_update=interrupt"), **kw)
    # generation (0.4 s) is hidden behind the learner: a step is train + update
    assert asyn.useful_tokens_per_s(2) == pytest.approx(tokens / (train + update), rel=0.02)
    assert 0 < asyn.staleness_max <= 2


def test_the_simulated_learner_step_costs_prompt_and_response_tokens():
    """Constant lengths L, prompts P: a sync step is L decode steps, then the learner over B x n x (P + L)
    tokens (before issue 38: the response tokens only), then the weight load."""
    L, P, a, k, update = 40, 24, 0.01, 1e-4, 0.05
    kw = {"steps": 6, "engines": 1, "step_s": lambda b, t, p: a, "update_s": update, "train_s": lambda n: k * n,
          "sample_length": _const(L), "prompt_tokens": P}
    sync = simulate(_cfg("async.max_staleness=0", "rollout.over_provision=1"), **kw)
    assert sync.useful_tokens_per_s(2) == pytest.approx(4 * 4 * L / (L * a + k * 4 * 4 * (L + P) + update), rel=1e-6)


def test_shared_host_slowdown_lengthens_only_steps_that_overlap_generation():
    """On one machine's cores (the tiny CPU task) learner and engines slow each other while both run:
    sync never overlaps them, so it is unchanged; learner-bound async pays the factor on every step;
    generation-bound async pays it on the decode steps beside training."""
    L, a, train, update, f = 40, 0.01, 0.7, 0.05, 1.5
    kw = {"steps": 8, "engines": 1, "step_s": lambda b, t, p: a, "update_s": update, "train_s": lambda n: train,
          "sample_length": _const(L), "prompt_tokens": 8}
    tokens = 4 * 4 * L
    sync_cfg = _cfg("async.max_staleness=0", "rollout.over_provision=1")
    assert simulate(sync_cfg, shared_host_slowdown=f, **kw).useful_tokens_per_s(2) == pytest.approx(
        simulate(sync_cfg, **kw).useful_tokens_per_s(2), rel=1e-9)
    asyn = simulate(_cfg("async.max_staleness=2", "rollout.over_provision=3", "rollout.on_weight_update=interrupt"),
                    shared_host_slowdown=f, **kw)
    assert asyn.useful_tokens_per_s(2) == pytest.approx(tokens / (f * train + update), rel=0.02)
    # generation-bound (40 decode steps of 0.1 s against a 0.7 s step): the 0.7 s beside training cost f
    slow = {**kw, "step_s": lambda b, t, p: 0.1}
    gen_bound = _cfg("async.max_staleness=1", "rollout.over_provision=1", "rollout.on_weight_update=continue")
    base_tps = simulate(gen_bound, **slow).useful_tokens_per_s(2)
    assert base_tps == pytest.approx(tokens / (L * 0.1 + update), rel=0.03)
    assert simulate(gen_bound, shared_host_slowdown=f, **slow).useful_tokens_per_s(2) == pytest.approx(
        tokens / (L * 0.1 + (f - 1) * f * train + update), rel=0.05)
    with pytest.raises(ValueError, match="shared_host_slowdown"):
        simulate(sync_cfg, shared_host_slowdown=0.5, **kw)


def test_simulation_never_trains_past_eta_and_ceiling_is_full_concurrency_rate():
    step = lambda b, t, p: 0.001 + 1e-4 * b + 1e-7 * t + 1e-6 * p
    lengths = lambda rng: int(rng.integers(1, 48))
    for eta, op, early in ((1, 2, "false"), (2, 3, "false"), (2, 2, "true")):
        res = simulate(_cfg(f"async.max_staleness={eta}", f"rollout.over_provision={op}", f"rollout.early_stop={early}",
                            "rollout.on_weight_update=interrupt"),
                       steps=10, engines=1, step_s=step, update_s=0.01, train_s=lambda n: 0.05, sample_length=lengths, prompt_tokens=8)
        assert res.staleness_max <= eta and len(res.step_times) == 10
    tps = engine_ceiling(concurrency=16, step_s=lambda b, t, p: 0.01, sample_length=_const(10), max_new_tokens=48, prompt_tokens=8)
    assert tps == pytest.approx(16 / 0.01)


def _plan(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["plan", TINY, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_every_row_and_recommends_the_best(capsys, tmp_path):
    hist = tmp_path / "lengths.json"
    hist.write_text(json.dumps({"8": 10, "20": 5, "48": 1}))
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(capsys, tmp_path, "rollout.batch_groups=4", "rollout.n_samples=4", "--lengths", str(hist), "--params", "1e6", "--latency", "0.01,0.0005,0,0.0001,0.05",
                           "--peak-tflops", "0.1", "--mfu", "0.05", "--steps", "5", "--gpus", "3", "--json", str(out_json))
    assert code == 0, err
    header = next(line for line in out.splitlines() if "useful_tok/s" in line)
    assert header.split() == list(COLUMNS)
    data = json.loads(out_json.read_text())
    settings = grid(3, 1)
    assert len(data["rows"]) == len(settings) == 2 * 12  # splits 1:2 and 2:1, 12 settings each
    table_rows = [line for line in out.splitlines() if line.strip().split()[:1] and ":" in line.split()[0] and line.split()[0][0].isdigit()]
    assert len(table_rows) == len(settings)
    assert sum("<- recommended" in line for line in table_rows) == 1
    best = max(r["useful_tokens_per_s"] for r in data["rows"])
    rec = data["recommended"]
    assert rec["useful_tokens_per_s"] >= (1 - TIE) * best
    assert "recommended:" in err and f"async.max_staleness={rec['setting']['eta']}" in err
    assert "TFLOP/s peak" in err and "MFU 0.05" in err  # the learner model's assumptions are stated
    for r in data["rows"]:
        assert r["ceiling"] == pytest.approx((r["gen_s"] + r["train_s"]) / max(r["gen_s"], r["train_s"]))
        assert r["staleness_max"] <= r["setting"]["eta"]
        assert r["vs_sync"] > 0 and not math.isnan(r["vs_sync"])


@pytest.mark.parametrize("args, message", [
    (["--lengths", "/nonexistent/h.json"], "no such file"),
    (["--gpus", "0"], "--gpus 0"),
    (["--gpus", "1"], "at least 2"),
    (["--latency", "1,2"], "--latency"),
    (["--shared-host-slowdown", "0.5"], "--shared-host-slowdown 0.5: must be a number >= 1"),
])
def test_plan_bad_input_is_one_clear_error(capsys, tmp_path, args, message):
    code, _out, err = _plan(capsys, tmp_path, "--params", "1e6", *args)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["{not json", '{"lengths": [1, 2]}', '{"-3": 4}', '{"abc": 1}', "[]"])
def test_plan_malformed_histogram_is_one_clear_error(capsys, tmp_path, text):
    hist = tmp_path / "h.json"
    hist.write_text(text)
    code, _out, err = _plan(capsys, tmp_path, "--params", "1e6", "--lengths", str(hist))
    assert code == 2 and "not a length histogram" in err and "JSON histogram" in err


def test_plan_help_and_missing_config(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "async-april plan" in out and "--lengths" in out and "a JSON file" in out
    assert cli_main(["plan", "/nonexistent/config.yaml", "--params", "1e6"]) == 2
    assert "/nonexistent/config.yaml" in capsys.readouterr().err


def test_a_cpu_config_gets_a_plan_of_its_cpu_run(capsys, tmp_path):
    """Issue 38: `async-april plan configs/tiny_cpu.yaml`, the README's own config, planned two H100s for a CPU run
    with every response at the 48-token cap (the APRIL lengths), so every row was 1.00x. Now: its first line says
    it plans the CPU run and what it assumes (costs measured on CPU cores), the reversal task's answer lengths
    give the long tail, and overlap shows (the measured async figure is 1.5-1.7x sync, docs/benchmarks.md)."""
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(capsys, tmp_path, "--steps", "6", "--json", str(out_json))
    assert code == 0, err
    first = err.splitlines()[0]
    assert "a CPU run (torch engine, learner on CPU) on 2 cores" in first and "benchmarks/plan_accuracy.py --tiny" in first
    assert "--gpus N plans a GPU run" in first
    data = json.loads(out_json.read_text())
    assert data["device"] == "core" and data["lengths"] == "builtin:reverse answers"
    ratios = [r["vs_sync"] for r in data["rows"]]
    assert max(ratios) > 1.2 and data["recommended"]["setting"]["mode"] != "sync"
    assert "rollout core(s) and 1 learner core(s)" in err
    code, _, err = _plan(capsys, tmp_path, "--steps", "3", "--gpus", "2", "--params", "1e6")
    assert code == 0 and "though this config trains on CPU (drop --gpus to plan its CPU run)" in err.splitlines()[0]


def test_the_cpu_calibration_is_the_tiny_benchmarks():
    """planning.CpuCalibration's engine and host figures are benchmarks/results/plan_accuracy_tiny.json's, rounded."""
    from pathlib import Path

    from async_april.planning.planner import CpuCalibration

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    cal = json.loads((results / "plan_accuracy_tiny.json").read_text())["calibration"]
    hist = {int(k): v for k, v in json.loads((results / "plan_tiny_lengths.json").read_text()).items()}
    mean_response = sum(k * v for k, v in hist.items()) / sum(hist.values())
    c = CpuCalibration()
    for ours, measured in ((c.engine_a, cal["latency"]["a"]), (c.engine_b, cal["latency"]["b"]),
                           (c.update_s, cal["latency"]["update_s"]), (c.shared_host_slowdown, cal["shared_host_slowdown"])):
        assert ours == pytest.approx(measured, rel=0.01)
    per_learner_token = cal.get("learner_s_per_token") if "learner_s_per_response_token" in cal else \
        cal["learner_s_per_token"] * mean_response / (mean_response + cal["prompt_tokens"])  # the response-only fit
    assert c.learner_flops == pytest.approx(6 * c.params / per_learner_token, rel=0.01)
