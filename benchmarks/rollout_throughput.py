"""Rollout throughput of the sync, APRIL and async modes, side by side in one run.

The same prompts, group size, max tokens and seed go through each mode (the
presets in configs/presets/), on the simulated engine with named length
distributions (`april`: 16k-token limit with a long tail that hits it;
`copris`: 8k-40k contexts; `lognormal`) around a simulated learner, and on the
torch engine with the tiny model around the real FSDP2 learner. Reported per
mode: useful tokens/s (response tokens trained per wall second, after a
warm-up step), engine idle fraction, utilisation (generated tokens/s over the
engine's steady state at full concurrency, measured in the same run), the
ratio to sync, and waste over the whole run: the share of generated tokens
that will never be trained (`rollout/wasted_tokens`), aborted tokens and
aborted tokens discarded.

    python benchmarks/rollout_throughput.py                      # both engines
    python benchmarks/rollout_throughput.py --engine simulated --steps 8
    python benchmarks/rollout_throughput.py --engine torch --steps 20
    python benchmarks/rollout_throughput.py --policies --engine both     # on_weight_update: interrupt / drain / continue
    python benchmarks/rollout_throughput.py --policies --engine torch --learner-step-s 0.2   # generation-bound
    python benchmarks/rollout_throughput.py --multi-turn --steps 8       # agents: sync vs async with tool latency

`--policies` runs the async preset once per `rollout.on_weight_update` policy
(plus sync as the baseline) and adds the engine's utilisation while busy
(utilisation / (1 - idle)), the decode batch's occupancy (running requests per decode step over
rollout.concurrency) and the tokens re-prefilled per step.

`--multi-turn` runs sync and async on the simulated engine with a tool-calling environment
(`rollout.env=builtin:simulated_tool`, actors/agents/simulated.py): 2-6 model turns per response,
each turn's length drawn from `lognormal` (median 300 tokens), a tool call after every turn whose
latency is lognormal (median MULTI_TURN_TOOL["median_s"] simulated seconds, sigma 1, capped at 60 s),
64 observation tokens per call. Useful tokens count model tokens only. Writes
rollout_throughput_multiturn.json.

Prints a table and writes benchmarks/results/rollout_throughput.json (rollout_throughput_ENGINE.json
with --engine).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import MODES, mode_config, run, write_json

from async_april.run.tracking import progress

SIM_WORKLOADS = {
    # name: (max_new_tokens, real seconds per simulated second). The scale keeps a sync step at a
    # few real seconds, so simulated GPU time, not Ray bookkeeping, dominates what is measured.
    "april": (16384, 0.004),
    "copris": (40960, 0.002),
    "lognormal": (4096, 0.03),
}


def summarize(rows: list[dict], warmup: int) -> dict[str, float]:
    generated, trained, last = sum(r["rollout/generated_tokens"] for r in rows), sum(r["rollout/tokens"] for r in rows), rows[-1]
    waste = {  # over the whole run, warm-up included: every generated token is trained, waiting, or wasted
        "generated_tokens": generated,
        "trained_tokens": trained,
        "wasted_tokens": last["rollout/wasted_tokens"],
        "wasted_frac": last["rollout/wasted_tokens"] / generated,
        "not_yet_trained_frac": (generated - trained) / generated,  # wasted + still in flight at the end
        "aborted_tokens": last["rollout/aborted_tokens"],
        "aborted_tokens_discarded": last["rollout/aborted_tokens_discarded"],
        "groups_requeued_stale": last["rollout/groups_requeued_stale"],
    }
    rows = rows[warmup:]
    wall = sum(r["timing_s/step"] for r in rows)
    return {
        **waste,
        "useful_tokens_per_s": sum(r["rollout/tokens"] for r in rows) / wall,
        "generated_tokens_per_s": sum(r["rollout/generated_tokens"] for r in rows) / wall,
        "engine_idle_frac": statistics.mean(r["perf/engine_idle_frac"] for r in rows),
        "engine_batch_occupancy": statistics.mean(r["perf/engine_batch_occupancy"] for r in rows),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "reward_mean": statistics.mean(r["rollout/reward_mean"] for r in rows),
        "reprefill_tokens_per_step": (rows[-1].get("rollout/reprefill_tokens", 0.0) - rows[0].get("rollout/reprefill_tokens", 0.0))
        / max(1, len(rows) - 1),
        "steps": len(rows),
        "wall_s": wall,
    }


async def _steady_state(engine, make_request, concurrency: int, seconds: float) -> float:
    """Tokens/s with `concurrency` requests always in flight (the engine's ceiling)."""
    await engine.start()
    produced, deadline, t0 = 0, time.perf_counter() + seconds, time.perf_counter()

    async def worker(k: int):
        nonlocal produced
        i = k
        while time.perf_counter() < deadline:
            res = await engine.generate(make_request(i))
            produced += len(res.output_ids)
            i += concurrency

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await engine.shutdown()
    return produced / elapsed


def steady_state_simulated(cfg, seconds: float) -> float:
    from actors.engine import GenerateRequest, SamplingParams
    from actors.engines.simulated import SimulatedEngine

    r = cfg.rollout
    engine = SimulatedEngine(r.simulated_lengths, max_running=r.concurrency, time_scale=r.simulated_time_scale)

    def req(i):
        return GenerateRequest(f"ss/{i}/", np.array([1, 2, 3, i % 97]), SamplingParams(r.max_new_tokens, seed=i), prompt_len=4)

    return asyncio.run(_steady_state(engine, req, r.concurrency, seconds))


def steady_state_torch(cfg, seconds: float) -> float:
    from transformers import AutoTokenizer

    from actors.engine import GenerateRequest, SamplingParams
    from actors.engines import make_engine
    from async_april.data import load_prompts
    from async_april.models.paths import resolve_model_path

    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    tok = AutoTokenizer.from_pretrained(path)
    data = load_prompts(cfg, tok)
    engine = make_engine(cfg, path, device="cpu", eos_token_ids=[tok.eos_token_id])
    r = cfg.rollout

    def req(i):
        ids = data.row(i).prompt_ids
        return GenerateRequest(f"ss/{i}/", ids, SamplingParams(r.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=i), prompt_len=len(ids))

    return on_engine_core(cfg, lambda: asyncio.run(_steady_state(engine, req, r.concurrency, seconds)))


def on_engine_core(cfg, measure):
    """Measure on the core a pinned run gives its engine (run.pin_cpus), so the ceiling and the runs match."""
    from async_april.hosts.cpu_pinning import cpu_plan, pin_process, process_cores

    plan, _ = cpu_plan(cfg.rollout.num_actors) if cfg.run.pin_cpus else (None, "")
    if plan is None:
        return measure()
    before = process_cores()
    pin_process((plan.engine_core(0),))
    try:
        return measure()
    finally:
        pin_process(before)


def bench_simulated(steps: int, tmp: Path) -> list[dict]:
    from learners.simulated import SimulatedLearner

    out = []
    for dist, (limit, scale) in SIM_WORKLOADS.items():
        over = ["rollout.engine=simulated", f"rollout.simulated_lengths={dist}", f"rollout.simulated_time_scale={scale}",
                "rollout.batch_groups=32", "rollout.n_samples=8", "rollout.num_actors=2", "rollout.concurrency=128", "run.pin_cpus=false",
                f"rollout.max_new_tokens={limit}", f"run.steps={steps}"]
        base = mode_config("sync", tmp, over)
        ceiling = steady_state_simulated(base, seconds=10.0)
        for mode in MODES:
            # Responses of thousands of tokens span several learner steps, so the async preset's
            # eta = 2 (tuned for the tiny task) would requeue them; eta = 4 as AReaL uses for long outputs.
            extra = ["async.max_staleness=4", "rollout.over_provision=5"] if mode == "async" else []
            cfg = mode_config(mode, tmp, over + extra)
            progress(f"simulated/{dist}: {mode}")
            rows = run(cfg, learner_factory=lambda *_: SimulatedLearner(step_s=30.0, time_scale=scale))
            s = summarize(rows, warmup=2)
            s["utilisation"] = s["generated_tokens_per_s"] / (ceiling * cfg.rollout.num_actors)
            out.append({"engine": "simulated", "workload": dist, "mode": mode, **s, "steady_state_tokens_per_s": ceiling})
    return out


def bench_torch(steps: int, tmp: Path) -> list[dict]:
    out = []
    over = [f"run.steps={steps}", "rollout.concurrency=64"]
    base = mode_config("sync", tmp, over)
    ceiling = steady_state_torch(base, seconds=15.0)
    for mode in MODES:
        cfg = mode_config(mode, tmp, over)
        progress(f"torch/tiny-reverse: {mode}")
        s = summarize(run(cfg), warmup=2)
        s["utilisation"] = s["generated_tokens_per_s"] / ceiling
        out.append({"engine": "torch", "workload": "tiny-reverse", "mode": mode, **s, "steady_state_tokens_per_s": ceiling})
    return out


MULTI_TURN_TOOL = {"median_s": 2.0, "sigma": 1.0, "max_s": 60.0, "min_turns": 2, "max_turns": 6, "obs_tokens": 64}
"""The simulated agent workload of --multi-turn (env_args of builtin:simulated_tool, simulated seconds)."""


def bench_multiturn(steps: int, tmp: Path) -> list[dict]:
    """Sync vs async on a simulated multi-turn workload with tool latency (module docstring)."""
    from learners.simulated import SimulatedLearner

    limit, scale = SIM_WORKLOADS["lognormal"]
    env_args = "{" + ", ".join(f"{k}: {v}" for k, v in {**MULTI_TURN_TOOL, "time_scale": scale}.items()) + "}"
    over = ["rollout.engine=simulated", "rollout.simulated_lengths=lognormal", f"rollout.simulated_time_scale={scale}",
            "rollout.batch_groups=32", "rollout.n_samples=8", "rollout.num_actors=2", "rollout.concurrency=128",
            "run.pin_cpus=false", "rollout.max_new_tokens=16384", f"run.steps={steps}",
            "rollout.env=builtin:simulated_tool", f"rollout.agent.env_args={env_args}",
            f"rollout.agent.max_turns={MULTI_TURN_TOOL['max_turns']}", f"rollout.agent.max_turn_tokens={limit}",
            f"rollout.agent.max_observation_tokens={MULTI_TURN_TOOL['obs_tokens']}",
            "rollout.agent.step_concurrency=128", "rollout.agent.step_timeout_s=600"]
    out = []
    for mode in ("sync", "async"):
        extra = ["async.max_staleness=4", "rollout.over_provision=5"] if mode == "async" else []  # as bench_simulated
        cfg = mode_config(mode, tmp, over + extra)
        progress(f"simulated/multi-turn: {mode}")
        rows = run(cfg, learner_factory=lambda *_: SimulatedLearner(step_s=30.0, time_scale=scale))
        s = summarize(rows, warmup=2)
        s["utilisation"] = None  # no steady-state ceiling: tool time is not engine time
        s["turns_mean"] = statistics.mean(r["rollout/turns_mean"] for r in rows[2:])
        s["tool_steps"] = rows[-1].get("agent/steps", 0.0)
        out.append({"engine": "simulated", "workload": "multi-turn", "mode": mode, **s, "tool": MULTI_TURN_TOOL})
    return out


POLICIES = ("interrupt", "drain", "continue")


def bench_policies(engine: str, steps: int, tmp: Path, learner_step_s: float | None = None) -> list[dict]:
    """Sync, then the async preset with each on_weight_update policy, on one workload per engine.
    `learner_step_s` (torch engine): a simulated learner that sleeps that long per step and moves no
    weights instead of the FSDP2 learner, so that generation, not training, sets the pace."""
    from learners.simulated import SimulatedLearner

    if engine == "simulated":
        limit, scale = SIM_WORKLOADS["april"]
        over = ["rollout.engine=simulated", "rollout.simulated_lengths=april", f"rollout.simulated_time_scale={scale}",
                "rollout.batch_groups=32", "rollout.n_samples=8", "rollout.num_actors=2", "rollout.concurrency=128",
                "run.pin_cpus=false", f"rollout.max_new_tokens={limit}", f"run.steps={steps}"]
        async_extra = ["async.max_staleness=4", "rollout.over_provision=5"]  # as in bench_simulated
        ceiling = steady_state_simulated(mode_config("sync", tmp, over), seconds=10.0) * 2
        factory, workload = (lambda *_: SimulatedLearner(step_s=30.0, time_scale=scale)), "april"
    else:
        over = [f"run.steps={steps}", "rollout.concurrency=64"]
        async_extra = []
        ceiling = steady_state_torch(mode_config("sync", tmp, over), seconds=15.0)
        factory, workload = None, "tiny-reverse"
        if learner_step_s is not None:
            factory = lambda cfg, model_path: FixedWeightsLearner(model_path, learner_step_s)  # noqa: E731
            workload = f"tiny/sim{learner_step_s:g}s"
    out = []
    for mode, policy in [("sync", "drain"), *(("async", p) for p in POLICIES)]:
        cfg = mode_config(mode, tmp, over + (async_extra if mode == "async" else []) + [f"rollout.on_weight_update={policy}"])
        progress(f"{engine}/{workload}: {mode} ({policy})")
        s = summarize(run(cfg, learner_factory=factory), warmup=2)
        s["utilisation"] = s["generated_tokens_per_s"] / ceiling
        s["utilisation_while_busy"] = s["utilisation"] / max(1e-9, 1.0 - s["engine_idle_frac"])
        out.append({"engine": engine, "workload": workload, "mode": mode if mode == "sync" else f"async/{policy}",
                    "on_weight_update": policy, **s, "steady_state_tokens_per_s": ceiling})
    return out


class FixedWeightsLearner:
    """A stand-in learner for a generation-bound run: sleeps `step_s` per step and sends the model's own,
    unchanged weights as one bucket, so the engine loads a full set at every update (as with the FSDP2
    learner) while training costs no CPU."""

    def __init__(self, model_path: str, step_s: float) -> None:
        import ray
        from transformers import AutoModelForCausalLM

        from learners.simulated import SimulatedLearner

        self._sim = SimulatedLearner(step_s=step_s, time_scale=1.0)
        model = AutoModelForCausalLM.from_pretrained(model_path)
        self._refs = [ray.put({k: v.detach().clone() for k, v in model.state_dict().items()})]

    def __getattr__(self, name: str):
        return getattr(self._sim, name)  # version, train_step, checkpoints: the simulated learner's

    def weight_buckets(self, bucket_mb: float) -> list:
        return self._refs


def policy_table(results: list[dict]) -> str:
    head = (f"{'engine':<10}{'workload':<14}{'mode':<17}{'useful tok/s':>13}{'x sync':>8}{'idle':>7}{'util':>7}"
            f"{'busy util':>10}{'occupancy':>10}{'reprefill/step':>15}{'stale':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['engine']:<10}{r['workload']:<14}{r['mode']:<17}{r['useful_tokens_per_s']:>13.0f}"
                     f"{r['useful_tokens_per_s_vs_sync']:>8.2f}{r['engine_idle_frac']:>7.2f}{r['utilisation']:>7.2f}"
                     f"{r['utilisation_while_busy']:>10.2f}{r['engine_batch_occupancy']:>10.2f}{r['reprefill_tokens_per_step']:>15.0f}{r['staleness_max']:>6}")
    return "\n".join(lines)


def add_ratios(results: list[dict]) -> None:
    for r in results:
        sync = next(x for x in results if x["engine"] == r["engine"] and x["workload"] == r["workload"] and x["mode"] == "sync")
        r["useful_tokens_per_s_vs_sync"] = r["useful_tokens_per_s"] / sync["useful_tokens_per_s"]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: list[dict]) -> str:
    head = (f"{'engine':<10}{'workload':<14}{'mode':<7}{'useful tok/s':>13}{'x sync':>8}{'idle':>7}{'util':>7}{'stale':>6}"
            f"{'wasted':>8}{'aborted':>9}{'discarded':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['engine']:<10}{r['workload']:<14}{r['mode']:<7}{r['useful_tokens_per_s']:>13.0f}"
                     f"{r['useful_tokens_per_s_vs_sync']:>8.2f}{r['engine_idle_frac']:>7.2f}{_fmt(r['utilisation']):>7}{r['staleness_max']:>6}"
                     f"{r['wasted_frac']:>8.1%}{r['aborted_tokens']:>9}{r['aborted_tokens_discarded']:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["simulated", "torch", "both"], default="both")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode (default: 8 simulated, 25 torch)")
    ap.add_argument("--policies", action="store_true", help="async preset per rollout.on_weight_update policy (and sync)")
    ap.add_argument("--learner-step-s", type=float, default=None,
                    help="with --policies --engine torch: a simulated learner taking this many seconds per step "
                         "(no weights move) instead of the FSDP2 one, so that generation sets the pace")
    ap.add_argument("--multi-turn", action="store_true", help="sync vs async on a simulated multi-turn workload with tool latency")
    a = ap.parse_args(argv)
    if a.learner_step_s is not None and not (a.policies and a.engine == "torch"):
        ap.error("--learner-step-s goes with --policies --engine torch")
    results: list[dict] = []
    if a.multi_turn:
        with tempfile.TemporaryDirectory(prefix="aa-bench-") as tmp:
            results = bench_multiturn(a.steps or 8, Path(tmp))
        add_ratios(results)
        print(table(results))
        print(f"wrote {write_json('rollout_throughput_multiturn.json', {'results': results})}")
        return
    if a.policies:
        engines = ["simulated", "torch"] if a.engine == "both" else [a.engine]
        with tempfile.TemporaryDirectory(prefix="aa-bench-") as tmp:
            for engine in engines:
                results += bench_policies(engine, a.steps or (8 if engine == "simulated" else 25), Path(tmp), a.learner_step_s)
        add_ratios(results)
        print(policy_table(results))
        name = "in_flight_updates.json" if a.engine == "both" else f"in_flight_updates_{a.engine}.json"
        if a.learner_step_s is not None:
            name = f"in_flight_updates_torch_learner{a.learner_step_s:g}s.json"
        print(f"wrote {write_json(name, {'results': results})}")
        return
    with tempfile.TemporaryDirectory(prefix="aa-bench-") as tmp:
        if a.engine in ("simulated", "both"):
            results += bench_simulated(a.steps or 8, Path(tmp))
        if a.engine in ("torch", "both"):
            results += bench_torch(a.steps or 25, Path(tmp))
    add_ratios(results)
    print(table(results))
    name = "rollout_throughput.json" if a.engine == "both" else f"rollout_throughput_{a.engine}.json"
    print(f"wrote {write_json(name, {'results': results})}")


if __name__ == "__main__":
    main()
