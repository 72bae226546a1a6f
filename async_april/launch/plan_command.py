"""`async-april plan CONFIG [KEY=VALUE ...] [--lengths HIST.json] [--gpus N] ...`: a capacity planner.

Before renting GPUs: for every rollout:learner split of `--gpus` and every mode (sync, APRIL,
async) at several eta and over-provisioning values (async_april/planning/planner.py `grid`), a
discrete-event simulation of the run (async_april/planning/simulator.py: the real store and its admission,
the simulated engine's latency model, a modelled learner) gives useful tokens/s, engine
utilisation, staleness and waste; the table shows them with the analytic ceiling
(gen + train) / max(gen, train) beside each, and the best row is the recommendation.

The config gives batch_groups, n_samples, concurrency, max_new_tokens and gpus_per_actor, and the
learner's extra forwards (the proximal policy's when its correction needs one, the KL reference's
when algorithm.kl_coef > 0); each row's mode sets early_stop and on_weight_update as its preset
(configs/presets/) does. A CPU config (torch engine, learner on CPU) gets a plan of its CPU run:
cores instead of GPUs, with costs measured on CPU cores (planning.CpuCalibration); --gpus plans GPUs.

    --lengths SPEC     response-length histogram: a JSON file {"length": count, ...} (or
                       [[length, count], ...], or {"lengths": [...], "counts": [...]}), a CSV of
                       length,count rows, or a preset name (april, copris, lognormal). Default: for
                       data.source builtin:reverse the task's answers (digits + EOS), else april,
                       the APRIL-shaped one the benchmarks use (median 4k, 16k limit).
                       Lengths are capped at rollout.max_new_tokens.
    --gpus N           GPUs to split (default: what the config reserves, at least 2); given for a CPU
                       config, it plans a GPU run of it
    --cores N          a CPU run's cores to split, one per engine and per learner rank (default: the
                       config's rollout.num_actors + learner.world_size, at least 2)
    --params P         trained parameters (default: counted from model.path; a LoRA base counts as frozen)
    --peak-tflops F    per-GPU peak, TFLOP/s (default 989, H100 bf16 dense; a CPU run: the measured
                       0.0232 per core at MFU 1)
    --mfu M            learner model FLOPs utilisation (default 0.4; a CPU run 1)
    --latency A,B,C,P[,U]  engine cost per decode step A + B * running + C * batch_tokens
                       + P * prefill_tokens, and U seconds per weight load (default: the simulated
                       engine's, a 4B model on one H100, scaled by params / 4e9; a CPU run: the
                       tiny model's on one core, scaled by params / 1.05e6)
    --shared-host-slowdown F  engines and learner on cores of one machine (the tiny CPU task): a
                       learner step beside generation, and the decode steps beside it, take F times
                       as long (measure F as the learner's seconds per token in an async run over a
                       sync run's; the engines' is assumed the same). Default 1: GPUs of their own;
                       a CPU run: the measured 1.23
    --prompt-tokens N  prompt length (default 256; builtin:reverse: the task's mean, 11)
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
from async_april.planning.planner import (
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
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--cores", type=int, default=None)
    ap.add_argument("--params", type=float, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--mfu", type=float, default=None)
    ap.add_argument("--latency", default=None)
    ap.add_argument("--shared-host-slowdown", type=float, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=None)
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


def count_params(cfg) -> tuple[float, float]:
    """(trained, frozen) parameters of model.path with learner.lora (frozen: a LoRA base)."""
    from async_april.models.paths import resolve_model_path
    from learners.lora import parameter_counts

    try:
        counts = parameter_counts(resolve_model_path(cfg.model.path, cfg.model.cache_dir), cfg.learner.lora)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read the model's config: say what to give instead
        raise UserError(f"could not count the parameters of model.path {cfg.model.path!r} ({e}); give --params") from None
    return float(counts["trainable"]), float(counts["total"] - counts["trainable"])


def extra_forwards(cfg) -> int:
    """No-grad forwards a learner step runs beside the training one: the proximal policy's
    (learners/update.py needs_proximal_forward) and the KL reference model's (algorithm.kl_coef > 0)."""
    from async_april.algorithms.losses import LossSettings
    from learners.update import needs_proximal_forward

    settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    return int(needs_proximal_forward(settings, cfg.learner.mini_batches)) + int(cfg.algorithm.kl_coef > 0)


def cpu_run(cfg) -> bool:
    """Whether `cfg` trains on CPU cores: the torch engine on no GPU, and the learner on CPU."""
    from async_april.launch.memory_check import learner_on_gpu

    return cfg.rollout.engine == "torch" and cfg.rollout.gpus_per_actor == 0 and not learner_on_gpu(cfg)


class TaskLengths:
    """data.source builtin:reverse: response lengths of a model that answers right (digits + EOS)."""

    def sample(self, rng) -> int:
        from async_april.tasks.reverse import answer_tokens

        return answer_tokens(rng)


def row_config(cfg, s: Setting, engines: int):
    early, policy = MODE_POLICY[s.mode]
    rollout = cfg.rollout.model_copy(update={"over_provision": s.over_provision, "early_stop": early,
                                             "on_weight_update": policy, "num_actors": engines})
    return cfg.model_copy(update={"rollout": rollout, "async_": cfg.async_.model_copy(update={"max_staleness": s.eta})})


def plan(cfg, *, lengths, gpus: int, learner: LearnerModel, latency, prompt_tokens: int = 256, steps: int = 12,
         settings: list[Setting] | None = None, shared_host_slowdown: float = 1.0) -> list[Row]:
    """Simulate every setting (default: the grid for `gpus`) and return the table's rows."""
    from async_april.planning.simulator import engine_ceiling, simulate

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
    learner_tokens = r.batch_groups * r.n_samples * (mean_len + prompt_tokens)  # the learner runs whole rows
    rows = []
    for s in settings:
        engines = s.rollout_gpus // per_engine
        res = simulate(row_config(cfg, s, engines), steps=steps, engines=engines, step_s=cost, update_s=latency.update_s,
                       train_s=lambda n, g=s.learner_gpus: learner.step_s(n, g), sample_length=lengths.sample,
                       prompt_tokens=prompt_tokens, shared_host_slowdown=shared_host_slowdown)
        rows.append(Row(s, res.useful_tokens_per_s(WARMUP), res.generated_tokens_per_s() / (engines * peak),
                        float(np.mean(res.staleness[WARMUP:])), res.staleness_max,
                        res.wasted_tokens / max(1, res.generated_tokens),
                        batch_tokens / (engines * peak), learner.step_s(int(learner_tokens), s.learner_gpus)))
    return with_sync_ratios(rows)


def main(argv: list[str]) -> int:
    from async_april.config import load_config
    from async_april.run.console import say
    from async_april.planning.planner import CpuCalibration

    a = parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    for flag, value, least in (("--gpus", a.gpus, "2 GPUs (one engine and one learner GPU)"),
                               ("--cores", a.cores, "2 cores (one engine and one learner core)")):
        if value is not None and value < 2:
            raise UserError(f"{flag} {value}: needs at least {least}")
    if a.prompt_tokens is not None and a.prompt_tokens < 1:
        raise UserError(f"--prompt-tokens {a.prompt_tokens}: must be >= 1")
    reverse = cfg.data.source == "builtin:reverse"
    lengths, lengths_name = (TaskLengths(), "builtin:reverse answers") if a.lengths is None and reverse else (
        load_lengths(a.lengths or "april"), a.lengths or "april")
    prompt_tokens = a.prompt_tokens if a.prompt_tokens is not None else 256
    if a.prompt_tokens is None and reverse:
        from async_april.tasks.reverse import MEAN_PROMPT_TOKENS

        prompt_tokens = round(MEAN_PROMPT_TOKENS)
    trained, frozen = (a.params, 0.0) if a.params is not None else count_params(cfg)
    r = cfg.rollout
    on_cpu = cpu_run(cfg) and a.gpus is None
    cal = CpuCalibration()
    scale = (trained + frozen) / cal.params
    peak = a.peak_tflops * 1e12 if a.peak_tflops is not None else (cal.learner_flops if on_cpu else None)
    learner = LearnerModel(trained, **({"peak_flops": peak} if peak is not None else {}),
                           **({"mfu": a.mfu} if a.mfu is not None else {"mfu": 1.0} if on_cpu else {}),
                           frozen=frozen, extra_forwards=extra_forwards(cfg))
    if on_cpu and a.latency is None:
        from actors.engines.simulated import LatencyModel

        latency = LatencyModel(cal.engine_a * scale, cal.engine_b * scale, 0.0, 0.0, cal.update_s * scale)
    else:
        latency = latency_model(a.latency, trained + frozen)
    slowdown = a.shared_host_slowdown if a.shared_host_slowdown is not None else (cal.shared_host_slowdown if on_cpu else 1.0)
    device = "core" if on_cpu else "GPU"
    if on_cpu:
        devices = a.cores if a.cores is not None else max(2, r.num_actors + cfg.learner.world_size)
        say(f"plan for {a.config}: a CPU run (torch engine, learner on CPU) on {devices} cores, one per engine and per "
            f"learner rank; costs measured for the {cal.params / 1e6:.3g}M-parameter tiny model on one core each of a 2-core "
            f"machine (benchmarks/plan_accuracy.py --tiny) x {scale:.3g} (params / {cal.params / 1e6:.3g}M), x "
            f"{slowdown:g} while engines and learner both run. For your machine, run that benchmark and pass --latency, "
            "--peak-tflops / --mfu and --shared-host-slowdown; --gpus N plans a GPU run of this config instead")
    else:
        devices = a.gpus if a.gpus is not None else max(2, r.num_actors * max(1, math.ceil(r.gpus_per_actor)) + cfg.learner.world_size)
        if cpu_run(cfg):
            say(f"plan for {a.config}: {devices} GPUs (H100-class, modelled), though this config trains on CPU "
                "(drop --gpus to plan its CPU run)")
    rows = plan(cfg, lengths=lengths, gpus=devices, learner=learner, latency=latency, prompt_tokens=prompt_tokens, steps=a.steps,
                shared_host_slowdown=slowdown)
    pick = recommend(rows)
    say(f"{'  ' if on_cpu or cpu_run(cfg) else f'plan for {a.config}: '}{devices} {device}s, batch {r.batch_groups} x {r.n_samples}, concurrency {r.concurrency} per engine, "
        f"max_new_tokens {r.max_new_tokens}, lengths {lengths_name}, prompts {prompt_tokens} tokens, {a.steps} steps per row "
        f"({WARMUP} warm-up)")
    say(learner.describe(device) + (f"; learner and engines x {slowdown:g} while both run (--shared-host-slowdown)"
                                    if slowdown != 1.0 else ""))
    say(f"engine model: {latency.a:.3g} + {latency.b:.3g} x running + {latency.c:.3g} x batch_tokens + "
        f"{latency.prefill_s_per_token:.3g} x prefill_tokens s per decode step, {latency.update_s:.3g} s per weight load "
        "(override with --latency)")
    print(table(rows, pick))
    for line in recommendation(pick, device):
        say(line)
    if a.json:
        out = {"device": device, "devices": devices, "gpus": devices, "lengths": lengths_name, "learner": asdict(learner),
               "latency": asdict(latency), "rows": [{**asdict(x), "ceiling": x.ceiling} for x in rows],
               "recommended": asdict(replace(pick))}
        Path(a.json).write_text(json.dumps(out, indent=2))
        say(f"wrote {a.json}")
    return 0
