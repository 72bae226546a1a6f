"""`async-april plan`'s predicted throughput against measured runs, and `max_staleness: auto` on a simulated workload.

--tiny: the tiny CPU task (torch engine, FSDP2 learner, configs/tiny_cpu.yaml). The planner's inputs
are measured first, in this run: the engine's steady-state tokens/s at two concurrencies (fitting
the latency model's a + b * running), the learner's seconds per response token and the response
lengths (histogram written to results/plan_tiny_lengths.json, given to the planner as --lengths)
from a sync run, and how much slower the learner runs beside generation on this machine's shared
cores (--shared-host-slowdown) from a short async run at eta 1, over-provisioning 1.5, a setting
outside the planner's grid. The planner then predicts useful tokens/s for sync and for its recommended
setting; the recommended one is run for real and both are compared (sync's measured figure is the
calibration run's own, so only its engine side is a prediction); async eta 4 with over-provisioning
5 and eta 2 with 2 are run and compared too, unless one of them is the recommendation.

--simulated: the APRIL-shaped simulated workload (as rollout_throughput.py's, B = 32 x 8, 2 engines
at concurrency 128, 16k limit) with a modelled learner: a 4B model on 2 H100s at MFU 0.4
(SimulatedLearner at the planner's seconds per token). Measured: the real system (Ray actors, the
store, the simulated engine in scaled real time) for sync, the planner's recommendation and async
eta 4, at PLAN_TIME_SCALE; predicted: `plan` for the same settings.

--auto: the same simulated workload, fixed eta 0, 1, 2, 4 (over_provision 5) against
`async.max_staleness: auto` (auto.max 4): useful tokens/s, side by side.

    python benchmarks/plan_accuracy.py --tiny --simulated --auto

Writes benchmarks/results/plan_accuracy_tiny.json, plan_accuracy_simulated.json, auto_eta_simulated.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import RESULTS, mode_config, read_rows, write_json
from rollout_throughput import SIM_WORKLOADS, steady_state_torch, summarize

from async_april.launch.plan_command import load_lengths, plan
from async_april.planning.planner import ASYNC_ETA_OP, LearnerModel, grid, recommend
from async_april.run.tracking import progress

WARMUP = 2
CPU_PEAK = 1e12
"""A nominal peak for the CPU learner: only peak x MFU matters, and MFU is fitted."""


def run_with(cfg, learner_factory=None, on_step=None) -> list[dict]:
    from async_april.launch.controller import train

    train(cfg, on_step=on_step, learner_factory=learner_factory)
    return read_rows(cfg.run_dir)


def bench_tiny(steps: int, tmp: Path) -> dict:
    from actors.engines.simulated import LatencyModel

    lens, prompts, rows_tokens = [], [], []

    def collect(step, batch, learner):
        lens.extend(int(x) for x in batch.response_lens)
        prompts.extend(int(x) for x in batch.prompt_lens)
        rows_tokens.append(int(sum(batch.response_lens) + sum(batch.prompt_lens)))  # what the planner's learner costs

    over = [f"run.steps={steps}", "rollout.concurrency=64"]
    progress("tiny: sync (calibration and measurement)")
    sync_rows = run_with(mode_config("sync", tmp, over), on_step=collect)
    per_response = statistics.median(r["timing_s/train"] / r["rollout/tokens"] for r in sync_rows[WARMUP:])
    # The planner costs a step by its rows' prompt + response tokens (async_april/planning/planner.py LearnerModel)
    s_per_token = statistics.median(r["timing_s/train"] / n for r, n in zip(sync_rows[WARMUP:], rows_tokens[WARMUP:]))
    hist = {str(k): lens.count(k) for k in sorted(set(lens))}
    hist_path = RESULTS / "plan_tiny_lengths.json"
    hist_path.write_text(json.dumps(hist))
    base = mode_config("sync", tmp, over)
    progress("tiny: engine steady state at concurrency 64 and 16")
    tps64 = steady_state_torch(base, seconds=12.0)
    tps16 = steady_state_torch(mode_config("sync", tmp, [*over[:1], "rollout.concurrency=16"]), seconds=12.0)
    # step_s = a + b * B, and tokens/s = B / step_s at B = 64 and 16
    b = (64 / tps64 - 16 / tps16) / 48
    a = max(0.0, 16 / tps16 - 16 * b)
    # Per step, weights and the controller's own work (batching, store calls) outside wait and train:
    # costed as the weight load, during which the planner's engines pause and its learner waits.
    update_s = statistics.median(r["timing_s/step"] - r["timing_s/rollout"] - r["timing_s/train"] for r in sync_rows[WARMUP:])
    # Engines and learner share this machine (one core each, the store and driver on the learner's): a
    # learner step is slower while the engine generates. Measured on an async setting outside the
    # planner's grid (eta 1, over-provisioning 1.5), never on the one it is checked against.
    eta, op = CALIBRATION_SETTING
    progress(f"tiny: async eta {eta}, over-provisioning {op:g}, {CALIBRATION_STEPS} steps (learner beside generation)")
    overlap_rows = run_with(mode_config("async", tmp, [f"run.steps={CALIBRATION_STEPS}", *over[1:], f"async.max_staleness={eta}",
                                                       f"rollout.over_provision={op:g}"]))
    overlapped = statistics.median(r["timing_s/train"] / r["rollout/tokens"] for r in overlap_rows[WARMUP:])
    slowdown = max(1.0, overlapped / per_response)
    latency = LatencyModel(a=a, b=max(0.0, b), c=0.0, prefill_s_per_token=0.0, update_s=update_s)
    params = 1.0e6
    learner = LearnerModel(params, CPU_PEAK, 6 * params / (s_per_token * CPU_PEAK))
    prompt_tokens = int(statistics.median(prompts))
    lengths = load_lengths(str(hist_path))
    rows = plan(base, lengths=lengths, gpus=2, learner=learner, latency=latency, prompt_tokens=prompt_tokens, steps=steps,
                shared_host_slowdown=slowdown)
    pick = recommend(rows)
    sync_row = next(r for r in rows if r.setting.mode == "sync")
    checked = [("sync", sync_row, sync_rows), ("recommended", pick, None)]
    for eta, op in TINY_ALSO_CHECKED:  # a high and a low over-provisioning, unless one is the pick
        row = next(r for r in rows if r.setting.mode == "async" and (r.setting.eta, r.setting.over_provision) == (eta, op))
        if row.setting != pick.setting:
            checked.append((f"async eta {eta}", row, None))
    out = []
    for label, row, measured in checked:
        if measured is None:
            progress(f"tiny: {row.setting} ({label})")
            measured = run_with(mode_config(row.setting.mode, tmp, over + row.setting.overrides))
        m = summarize(measured, warmup=WARMUP)["useful_tokens_per_s"]
        out.append({"workload": "tiny", "label": label, "setting": row.setting.__dict__, "predicted": row.useful_tokens_per_s,
                    "measured": m, "error": row.useful_tokens_per_s / m - 1})
    return {"rows": out, "calibration": {"latency": latency.__dict__, "learner_s_per_token": s_per_token,
                                         "learner_s_per_response_token": per_response,
                                         "learner_s_per_token_beside_generation": overlapped, "shared_host_slowdown": slowdown,
                                         "learner_mfu_at_1tflops": learner.mfu, "engine_tps64": tps64, "engine_tps16": tps16,
                                         "prompt_tokens": prompt_tokens, "lengths": str(hist_path)}}


TINY_ALSO_CHECKED = ((4, 5.0), (2, 2.0))
"""Async settings run beside the recommendation on the tiny task: over-provisioning eta + 1 and 2."""
CALIBRATION_SETTING = (1, 1.5)
"""(eta, over_provision) of the async run that measures the slowdown: outside the planner's grid."""
assert CALIBRATION_SETTING not in ASYNC_ETA_OP
CALIBRATION_STEPS = 14
"""Steps of the async run that measures the learner's slowdown beside generation (2 of them warm-up)."""
SIM_PARAMS, SIM_LEARNER_GPUS = 4e9, 2


PLAN_TIME_SCALE = 0.02
"""Real seconds per simulated second of the measured runs that check the planner: 5x rollout_throughput.py's,
so that Ray's own latency on a shared machine (tens of ms per call) is a small part of each step."""


def sim_overrides(steps: int, scale: float | None = None) -> tuple[list[str], float]:
    limit, default = SIM_WORKLOADS["april"]
    scale = scale or default
    return (["rollout.engine=simulated", "rollout.simulated_lengths=april", f"rollout.simulated_time_scale={scale}",
             "rollout.batch_groups=32", "rollout.n_samples=8", "rollout.num_actors=2", "rollout.concurrency=128",
             "run.pin_cpus=false", f"rollout.max_new_tokens={limit}", f"run.steps={steps}"], scale)


def sim_run(mode: str, extra: list[str], steps: int, tmp: Path, scale: float | None = None) -> dict:
    from learners.simulated import SimulatedLearner

    over, scale = sim_overrides(steps, scale)
    spt = LearnerModel(SIM_PARAMS).s_per_token(SIM_LEARNER_GPUS)
    cfg = mode_config(mode, tmp, over + extra)
    rows = run_with(cfg, learner_factory=lambda *_: SimulatedLearner(step_s=0.0, s_per_token=spt, time_scale=scale))
    s = summarize(rows, warmup=WARMUP)
    s["useful_tokens_per_s_sim"] = s["useful_tokens_per_s"] * scale  # per simulated second
    s["eta_final"] = rows[-1].get("async/eta")
    return s


def bench_simulated(steps: int, tmp: Path) -> dict:
    from actors.engines.simulated import LatencyModel

    over, _ = sim_overrides(steps)
    base = mode_config("sync", tmp, over)
    learner, lengths = LearnerModel(SIM_PARAMS), load_lengths("april")
    # The 2:2 split's main rows of the grid (the whole grid takes minutes on a shared machine); prompts are
    # the tiny task's (~8 tokens), which the measured runs use too
    keep = {("sync", 0, 1.0), ("april", 4, 2.0), ("async", 2, 3.0), ("async", 4, 2.0), ("async", 4, 5.0), ("async", 8, 9.0)}
    grid_rows = plan(base, lengths=lengths, gpus=4, learner=learner, latency=LatencyModel(), steps=steps, prompt_tokens=8,
                     settings=[s for s in grid(4, 1) if s.rollout_gpus == 2 and (s.mode, s.eta, s.over_provision) in keep])
    pick = recommend(grid_rows)
    chosen = [next(r for r in grid_rows if r.setting.mode == "sync"), pick]
    other = next(r for r in grid_rows if r.setting.mode == "async" and r.setting.eta == 4 and r.setting.over_provision == 5.0)
    if other is not pick:
        chosen.append(other)
    out = []
    for row in chosen:
        progress(f"simulated: {row.setting}")
        m = sim_run(row.setting.mode, row.setting.overrides, steps, tmp, PLAN_TIME_SCALE)
        out.append({"workload": "simulated april", "label": "recommended" if row is pick else row.setting.mode,
                    "setting": row.setting.__dict__, "predicted": row.useful_tokens_per_s, "measured": m["useful_tokens_per_s_sim"],
                    "error": row.useful_tokens_per_s / m["useful_tokens_per_s_sim"] - 1, "measured_detail": m})
    return {"rows": out, "grid": [{**r.setting.__dict__, "useful_tokens_per_s": r.useful_tokens_per_s} for r in grid_rows]}


def bench_auto(steps: int, tmp: Path) -> list[dict]:
    out = []
    for label, extra in [*((f"eta {e}", [f"async.max_staleness={e}"]) for e in (0, 1, 2, 4)),
                         ("eta auto", ["async.max_staleness=auto", "async.auto.max=4"])]:
        progress(f"simulated auto: {label}")
        m = sim_run("async", [*extra, "rollout.over_provision=5"], steps, tmp)
        out.append({"label": label, "useful_tokens_per_s_sim": m["useful_tokens_per_s_sim"], "staleness_max": m["staleness_max"],
                    "eta_final": m["eta_final"], "engine_idle_frac": m["engine_idle_frac"]})
    best = max(r["useful_tokens_per_s_sim"] for r in out if r["label"] != "eta auto")
    for r in out:
        r["vs_best_fixed"] = r["useful_tokens_per_s_sim"] / best
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--simulated", action="store_true")
    ap.add_argument("--auto", action="store_true")
    ap.add_argument("--tiny-steps", type=int, default=30)
    ap.add_argument("--sim-steps", type=int, default=12)
    ap.add_argument("--auto-steps", type=int, default=30)
    a = ap.parse_args(argv)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="aa-plan-") as tmp:
        if a.tiny:
            result["tiny"] = bench_tiny(a.tiny_steps, Path(tmp))
            write_json("plan_accuracy_tiny.json", result["tiny"])
        if a.simulated:
            result["simulated"] = bench_simulated(a.sim_steps, Path(tmp))
            write_json("plan_accuracy_simulated.json", result["simulated"])
        if a.auto:
            auto = bench_auto(a.auto_steps, Path(tmp))
            print(f"{'run':<10}{'useful tok/s (sim)':>20}{'x best fixed':>14}{'eta at end':>12}{'stale max':>11}")
            for r in auto:
                print(f"{r['label']:<10}{r['useful_tokens_per_s_sim']:>20.0f}{r['vs_best_fixed']:>14.3f}{r['eta_final']!s:>12}"
                      f"{r['staleness_max']:>11}")
            print(f"wrote {write_json('auto_eta_simulated.json', {'steps': a.auto_steps, 'results': auto})}")
    rows = [r for part in ("tiny", "simulated") if part in result for r in result[part]["rows"]]
    if rows:
        print(f"{'workload':<17}{'run':<13}{'mode':>6}{'eta':>5}{'op':>5}{'predicted':>12}{'measured':>12}{'error':>8}")
        for r in rows:
            s = r["setting"]
            print(f"{r['workload']:<17}{r['label']:<13}{s['mode']:>6}{s['eta']:>5}{s['over_provision']:>5g}{r['predicted']:>12.1f}"
                  f"{r['measured']:>12.1f}{r['error']:>8.1%}")
        print("wrote " + ", ".join(f"plan_accuracy_{part}.json" for part in ("tiny", "simulated") if part in result))


if __name__ == "__main__":
    main()
