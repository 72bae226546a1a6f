"""`async-april plan CONFIG [KEY=VALUE ...] [--lengths HIST.json] [--gpus N] ...`: a capacity planner.

Before renting GPUs: for every rollout:learner split of `--gpus` and every mode (sync, APRIL,
async) at several eta and over-provisioning values (async_april/planning.py `grid`), a
discrete-event simulation of the run (async_april/plan_sim.py: the real store and its admission,
the simulated engine's latency model, a modelled learner) gives useful tokens/s, engine
utilisation, staleness and waste; the table shows them with the analytic ceiling
(gen + train) / max(gen, train) beside each, and the best row is the recommendation.

The config gives batch_groups, n_samples, concurrency, max_new_tokens and gpus_per_actor; each
row's mode sets early_stop and on_weight_update as its preset (configs/presets/) does.

    --lengths SPEC     response-length histogram: a JSON file {"length": count, ...} (or
                       [[length, count], ...], or {"lengths": [...], "counts": [...]}), a CSV of
                       length,count rows, or a preset name (april, copris, lognormal). Default:
                       april, the APRIL-shaped one the benchmarks use (median 4k, 16k limit).
                       Lengths are capped at rollout.max_new_tokens.
    --gpus N           GPUs to split (default: what the config reserves, at least 2)
    --params P         trained parameters (default: counted from model.path)
    --peak-tflops F    per-GPU peak, TFLOP/s (default 989, H100 bf16 dense)
    --mfu M            learner model FLOPs utilisation (default 0.4)
    --latency A,B,C,P[,U]  engine cost per decode step A + B * running + C * batch_tokens
                       + P * prefill_tokens, and U seconds per weight load (default: the simulated
                       engine's, a 4B model on one H100, scaled by params / 4e9)
    --shared-host-slowdown F  engines and learner on cores of one machine (the tiny CPU task): a
                       learner step beside generation, and the decode steps beside it, take F times
                       as long (measure F as the learner's seconds per token in an async run over a
                       sync run's; the engines' is assumed the same). Default 1: GPUs of their own
    --prompt-tokens N  prompt length (default 256)
    --steps N          learner steps simulated per row (default 12; the first 2 are warm-up)
    --json FILE        also write the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from async_april.errors import UserError
from async_april.planning import (
    LearnerModel,
    Row,
    Setting,
    grid,
    recommend,
    recommendation,
    table,
    with_sync_ratios,
)

MODE_POLICY = {"sync": (False, "drain"), "april": (True, "interrupt"), "async": (False, "interrupt")}
"""(early_stop, on_weight_update) of each mode, as in configs/presets/."""
REFERENCE_PARAMS = 4e9
"""The simulated engine's default latency model is a 4B model's (actors/engines/simulated.py)."""
WARMUP = 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="async-april plan", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 3)[3])
    ap.add_argument("config", metavar="CONFIG")
    ap.add_argument("overrides", metavar="KEY=VALUE", nargs="*")
    ap.add_argument("--lengths", default="april")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--params", type=float, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--mfu", type=float, default=None)
    ap.add_argument("--latency", default=None)
    ap.add_argument("--shared-host-slowdown", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def load_lengths(spec: str):
    """The simulated engine's length distribution for `spec`, or a UserError naming the format."""
    from actors.engines.simulated import LengthDistribution

    fmt = ('a JSON histogram {"length": count, ...} (or [[length, count], ...] or {"lengths": [...], "counts": [...]}), '
           "a CSV of length,count rows, or a preset (april, copris, lognormal)")
    if spec not in ("april", "copris", "lognormal") and not Path(spec).expanduser().is_file():
        raise UserError(f"--lengths {spec}: no such file; give {fmt}")
    try:
        return LengthDistribution(str(Path(spec).expanduser()) if Path(spec).expanduser().is_file() else spec)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"--lengths {spec}: not a length histogram ({type(e).__name__}: {e}); give {fmt}") from None


def latency_model(arg: str | None, params: float):
    from actors.engines.simulated import LatencyModel

    if arg is None:
        d, k = LatencyModel(), params / REFERENCE_PARAMS
        return LatencyModel(d.a * k, d.b, d.c * k, d.prefill_s_per_token * k, d.update_s * k)
    try:
        vals = [float(x) for x in arg.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (4, 5) or any(v < 0 or not math.isfinite(v) for v in vals):
        raise UserError(f"--latency {arg}: give 4 or 5 non-negative numbers A,B,C,P[,U] (seconds per decode step "
                        "A + B * running + C * batch_tokens + P * prefill_tokens, U per weight load)")
    return LatencyModel(*vals)


def count_params(cfg) -> float:
    from async_april.models.paths import resolve_model_path
    from learners.lora import parameter_counts

    try:
        return float(parameter_counts(resolve_model_path(cfg.model.path, cfg.model.cache_dir), cfg.learner.lora)["trainable"])
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read the model's config: say what to give instead
        raise UserError(f"could not count the parameters of model.path {cfg.model.path!r} ({e}); give --params") from None


def row_config(cfg, s: Setting, engines: int):
    early, policy = MODE_POLICY[s.mode]
    rollout = cfg.rollout.model_copy(update={"over_provision": s.over_provision, "early_stop": early,
                                             "on_weight_update": policy, "num_actors": engines})
    return cfg.model_copy(update={"rollout": rollout, "async_": cfg.async_.model_copy(update={"max_staleness": s.eta})})


def plan(cfg, *, lengths, gpus: int, learner: LearnerModel, latency, prompt_tokens: int = 256, steps: int = 12,
         settings: list[Setting] | None = None, shared_host_slowdown: float = 1.0) -> list[Row]:
    """Simulate every setting (default: the grid for `gpus`) and return the table's rows."""
    from async_april.plan_sim import engine_ceiling, simulate

    if steps <= WARMUP:
        raise UserError(f"--steps {steps}: needs more than the {WARMUP} warm-up steps")
    if not (shared_host_slowdown >= 1.0 and math.isfinite(shared_host_slowdown)):
        raise UserError(f"--shared-host-slowdown {shared_host_slowdown:g}: must be a number >= 1 (1: the learner's "
                        "GPUs are its own; above 1: how many times longer a learner step takes while the engines generate)")
    r = cfg.rollout
    per_engine = max(1, math.ceil(r.gpus_per_actor))
    settings = settings if settings is not None else grid(gpus, per_engine)
    cost = latency.step_s
    peak = engine_ceiling(concurrency=r.concurrency, step_s=cost, sample_length=lengths.sample, max_new_tokens=r.max_new_tokens,
                          prompt_tokens=prompt_tokens)
    rng = np.random.default_rng(1)
    mean_len = float(np.mean([min(r.max_new_tokens, lengths.sample(rng)) for _ in range(4000)]))
    batch_tokens = r.batch_groups * r.n_samples * mean_len
    rows = []
    for s in settings:
        engines = s.rollout_gpus // per_engine
        res = simulate(row_config(cfg, s, engines), steps=steps, engines=engines, step_s=cost, update_s=latency.update_s,
                       train_s=lambda n, g=s.learner_gpus: learner.step_s(n, g), sample_length=lengths.sample,
                       prompt_tokens=prompt_tokens, shared_host_slowdown=shared_host_slowdown)
        rows.append(Row(s, res.useful_tokens_per_s(WARMUP), res.generated_tokens_per_s() / (engines * peak),
                        float(np.mean(res.staleness[WARMUP:])), res.staleness_max,
                        res.wasted_tokens / max(1, res.generated_tokens),
                        batch_tokens / (engines * peak), learner.step_s(int(batch_tokens), s.learner_gpus)))
    return with_sync_ratios(rows)


def main(argv: list[str]) -> int:
    from async_april.config import load_config
    from async_april.console import say

    a = parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if a.gpus is not None and a.gpus < 2:
        raise UserError(f"--gpus {a.gpus}: needs at least 2 GPUs (one engine and one learner GPU)")
    if a.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens {a.prompt_tokens}: must be >= 1")
    lengths = load_lengths(a.lengths)
    params = a.params if a.params is not None else count_params(cfg)
    learner = LearnerModel(params, **({"peak_flops": a.peak_tflops * 1e12} if a.peak_tflops is not None else {}),
                           **({"mfu": a.mfu} if a.mfu is not None else {}))
    latency = latency_model(a.latency, params)
    r = cfg.rollout
    gpus = a.gpus if a.gpus is not None else max(2, r.num_actors * max(1, math.ceil(r.gpus_per_actor)) + cfg.learner.world_size)
    rows = plan(cfg, lengths=lengths, gpus=gpus, learner=learner, latency=latency, prompt_tokens=a.prompt_tokens, steps=a.steps,
                shared_host_slowdown=a.shared_host_slowdown)
    pick = recommend(rows)
    say(f"plan for {a.config}: {gpus} GPUs, batch {r.batch_groups} x {r.n_samples}, concurrency {r.concurrency} per engine, "
        f"max_new_tokens {r.max_new_tokens}, lengths {a.lengths}, prompts {a.prompt_tokens} tokens, {a.steps} steps per row "
        f"({WARMUP} warm-up)")
    say(learner.describe() + (f"; learner and engines x {a.shared_host_slowdown:g} while both run (--shared-host-slowdown)"
                              if a.shared_host_slowdown != 1.0 else ""))
    say(f"engine model: {latency.a:.3g} + {latency.b:.3g} x running + {latency.c:.3g} x batch_tokens + "
        f"{latency.prefill_s_per_token:.3g} x prefill_tokens s per decode step, {latency.update_s:.3g} s per weight load "
        "(override with --latency)")
    print(table(rows, pick))
    for line in recommendation(pick):
        say(line)
    if a.json:
        out = {"gpus": gpus, "lengths": a.lengths, "learner": asdict(learner), "latency": asdict(latency),
               "rows": [{**asdict(x), "ceiling": x.ceiling} for x in rows], "recommended": asdict(replace(pick))}
        Path(a.json).write_text(json.dumps(out, indent=2))
        say(f"wrote {a.json}")
    return 0
