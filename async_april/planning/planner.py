"""The capacity planner's model: a learner's step time, the grid of settings, the table, the pick.

Pure logic (no Ray, no engine): `async_april/planning/simulator.py` simulates each setting and
`async_april/launch/plan_command.py` (`async-april plan`) wires both to a config.

    modelled learner   train_s(tokens) = flops per token * tokens / (learner_gpus * peak_flops * mfu)
                       tokens = the batch's prompt + response tokens (the learner runs whole rows);
                       flops per token = 6 x trained params (forward + backward of a dense model)
                       + 4 x frozen params (a LoRA base: forward and input gradients, no weight gradients)
                       + 2 x all params per extra no-grad forward (the proximal policy's, when the
                       correction needs it: learners/update.py needs_proximal_forward; the KL
                       reference's, when algorithm.kl_coef > 0)
    a CPU run          (torch engine, learner on CPU) the same model with costs measured on CPU cores
                       (`CpuCalibration`): splits of cores, not GPUs
    analytic ceiling   (gen + train) / max(gen, train): the speed-up over sync that perfect
                       overlap of generation and training could give, where gen is one batch's
                       tokens at the engines' full-concurrency rate and train the step above
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from async_april.errors import UserError

H100_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H100 SXM (no sparsity), the default `--peak-tflops`."""
DEFAULT_MFU = 0.4
"""Model FLOPs utilisation of an RL learner step (FSDP, packed micro-batches): a typical figure, stated in the output."""


@dataclass(frozen=True)
class LearnerModel:
    params: float
    """Trained parameters (all of them for full fine-tuning)."""
    peak_flops: float = H100_BF16_FLOPS
    """Per GPU (a CPU run: per core), FLOP/s."""
    mfu: float = DEFAULT_MFU
    frozen: float = 0.0
    """Parameters that are not trained but run (a LoRA base)."""
    extra_forwards: int = 0
    """No-grad forwards per step beside the training one: the proximal policy's, the KL reference's."""

    def __post_init__(self) -> None:
        if self.params <= 0 or self.peak_flops <= 0 or not 0 < self.mfu <= 1 or self.frozen < 0 or self.extra_forwards < 0:
            raise UserError(f"learner model needs params > 0, peak FLOP/s > 0 and 0 < MFU <= 1 (got {self}); "
                            "fix --params, --peak-tflops or --mfu")

    @property
    def flops_per_token(self) -> float:
        return 6.0 * self.params + 4.0 * self.frozen + 2.0 * (self.params + self.frozen) * self.extra_forwards

    def s_per_token(self, gpus: int) -> float:
        """Seconds per prompt or response token of a step on `gpus` devices."""
        return self.flops_per_token / (gpus * self.peak_flops * self.mfu)

    def step_s(self, tokens: int, gpus: int) -> float:
        """A step over `tokens` prompt + response tokens."""
        return tokens * self.s_per_token(gpus)

    def describe(self, device: str = "GPU") -> str:
        terms = [f"6 x {self.params:.3g} trained"] + ([f"4 x {self.frozen:.3g} frozen"] if self.frozen else []) + (
            [f"2 x {self.params + self.frozen:.3g} x {self.extra_forwards} extra forward(s)"] if self.extra_forwards else [])
        return (f"learner model: ({' + '.join(terms)}) params x (prompt + response) tokens / ({device}s x "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s peak x MFU {self.mfu:g}) (override with --params, --peak-tflops, --mfu)")


@dataclass(frozen=True)
class CpuCalibration:
    """A CPU run's costs (torch engine and learner on one core each of a 2-core machine, the tiny model of
    1.05M parameters), measured by benchmarks/plan_accuracy.py --tiny (benchmarks/results/plan_accuracy_tiny.json
    `calibration`, docs/benchmarks.md "Capacity planner"). A CPU config's plan scales them by its parameters."""

    params: float = 1.05e6
    engine_a: float = 1.78e-3
    """Seconds per decode step (fitted a of a + b x running, from the engine's steady state at concurrency 16 and 64)."""
    engine_b: float = 3.96e-4
    """Seconds per decode step per running request."""
    update_s: float = 0.0456
    """Per step: the weight load and the controller's own work (the sync run's step minus wait and train)."""
    learner_flops: float = 2.32e10
    """6 x params x (prompt + response) tokens per second of timing_s/train: 0.476 ms per response token of mean
    9.25 with 7-token prompts (the sync run's median), i.e. 0.271 ms per learner token."""
    shared_host_slowdown: float = 1.23
    """A learner step beside generation over one without (0.59 / 0.48 ms per token): the cores share one machine."""


def ceiling(gen_s: float, train_s: float) -> float:
    """(gen + train) / max(gen, train): overlap's best speed-up over running them one after the other."""
    if gen_s < 0 or train_s < 0 or gen_s + train_s == 0:
        raise ValueError(f"ceiling needs gen_s, train_s >= 0, not both 0 (got {gen_s}, {train_s})")
    return (gen_s + train_s) / max(gen_s, train_s)


@dataclass(frozen=True)
class Setting:
    mode: str
    """sync, april or async: which preset (configs/presets/) the row starts from."""
    rollout_gpus: int
    learner_gpus: int
    eta: int
    over_provision: float

    @property
    def overrides(self) -> list[str]:
        """The config overrides this row runs with (on top of its mode's preset)."""
        return [f"async.max_staleness={self.eta}", f"rollout.over_provision={self.over_provision:g}"]


SYNC_ETA_OP = [(0, 1.0)]
APRIL_ETA_OP = [(2, 1.5), (2, 2.0), (4, 1.5), (4, 2.0)]
ASYNC_ETA_OP = [(1, 2.0), (2, 2.0), (2, 3.0), (4, 2.0), (4, 5.0), (8, 2.0), (8, 9.0)]
"""The grid per split: async with over_provision = eta + 1 (enough groups in flight to run eta
ahead, docs/async.md) and with a small fixed 2; APRIL around its preset (eta 4, 2x)."""


def splits(total_gpus: int, gpus_per_engine: int, most: int = 4) -> list[tuple[int, int]]:
    """(rollout GPUs, learner GPUs) splits of `total_gpus`: whole engines, at least one learner GPU,
    at most `most` of them evenly spread."""
    if total_gpus < 1:
        raise UserError(f"--gpus must be a positive number of GPUs (got {total_gpus})")
    g = max(1, gpus_per_engine)
    options = [(r, total_gpus - r) for r in range(g, total_gpus, g)]
    if not options:
        raise UserError(f"--gpus {total_gpus} leaves no split: one engine needs {g} GPU(s) and the learner at least 1; "
                        f"give --gpus >= {g + 1}")
    if len(options) <= most:
        return options
    picks = sorted({round(i * (len(options) - 1) / (most - 1)) for i in range(most)})
    return [options[i] for i in picks]


def grid(total_gpus: int, gpus_per_engine: int) -> list[Setting]:
    out = []
    for r, t in splits(total_gpus, gpus_per_engine):
        for mode, points in (("sync", SYNC_ETA_OP), ("april", APRIL_ETA_OP), ("async", ASYNC_ETA_OP)):
            out += [Setting(mode, r, t, eta, op) for eta, op in points]
    return out


@dataclass(frozen=True)
class Row:
    setting: Setting
    useful_tokens_per_s: float
    utilisation: float
    """Generated tokens/s over the engines' full-concurrency rate."""
    staleness_mean: float
    staleness_max: int
    wasted_frac: float
    gen_s: float
    train_s: float
    vs_sync: float = math.nan
    """Useful tokens/s over sync's at the same split."""

    @property
    def ceiling(self) -> float:
        return ceiling(self.gen_s, self.train_s)


def with_sync_ratios(rows: list[Row]) -> list[Row]:
    from dataclasses import replace

    sync = {(r.setting.rollout_gpus, r.setting.learner_gpus): r.useful_tokens_per_s for r in rows if r.setting.mode == "sync"}
    return [replace(r, vs_sync=r.useful_tokens_per_s / sync[(r.setting.rollout_gpus, r.setting.learner_gpus)])
            if (r.setting.rollout_gpus, r.setting.learner_gpus) in sync else r for r in rows]


TIE = 0.005
"""Rows within this share of the most useful tokens/s count as equal: the simulation is not finer."""


def recommend(rows: list[Row]) -> Row:
    """The best row: the most useful tokens/s; among rows within `TIE` of it, the least stale (then the
    lower eta and over-provisioning), since staleness costs learning and buys nothing there."""
    if not rows:
        raise ValueError("no rows to recommend from")
    best = max(r.useful_tokens_per_s for r in rows)
    near = [r for r in rows if r.useful_tokens_per_s >= (1 - TIE) * best]
    return min(near, key=lambda r: (r.staleness_mean, r.setting.eta, r.setting.over_provision, -r.useful_tokens_per_s))


COLUMNS = ("split", "mode", "eta", "over_prov", "useful_tok/s", "x_sync", "util", "stale_mean", "stale_max", "wasted",
           "gen_s", "train_s", "ceiling")
"""The table's columns, in order (tests check them)."""


def table(rows: list[Row], pick: Row) -> str:
    head = (f"{'split':>7}{'mode':>7}{'eta':>5}{'over_prov':>10}{'useful_tok/s':>14}{'x_sync':>8}{'util':>7}"
            f"{'stale_mean':>11}{'stale_max':>10}{'wasted':>8}{'gen_s':>9}{'train_s':>9}{'ceiling':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r.setting
        mark = "  <- recommended" if r is pick else ""
        lines.append(f"{f'{s.rollout_gpus}:{s.learner_gpus}':>7}{s.mode:>7}{s.eta:>5}{s.over_provision:>10g}"
                     f"{r.useful_tokens_per_s:>14.4g}{r.vs_sync:>8.2f}{r.utilisation:>7.2f}{r.staleness_mean:>11.2f}"
                     f"{r.staleness_max:>10}{r.wasted_frac:>8.1%}{r.gen_s:>9.3g}{r.train_s:>9.3g}{r.ceiling:>8.2f}{mark}")
    return "\n".join(lines)


def recommendation(pick: Row, device: str = "GPU") -> list[str]:
    s = pick.setting
    return [(f"recommended: {s.mode} on {s.rollout_gpus} rollout {device}(s) and {s.learner_gpus} learner {device}(s), "
            f"{pick.useful_tokens_per_s:.4g} useful tokens/s ({pick.vs_sync:.2f}x sync), mean staleness {pick.staleness_mean:.2f}"),
            f"  config: defaults: [presets/{s.mode}.yaml]; {' '.join(s.overrides)}"]
