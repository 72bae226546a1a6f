"""Discrete-event simulation of a run for the capacity planner: the real store, a virtual clock.

`simulate` drives the real `RolloutStore` (its `StalenessController` admission,
partials-first work order, earliest-deadline batching and stale policy) the way
the controller and the generation actors do, but on simulated seconds: nothing
sleeps, so a run of many minutes of GPU time takes a fraction of a second.

    engines   each leases up to `concurrency` samples (in blocks, as a generation actor does),
              decodes them with a batch cost `step_s(running, batch_tokens, prefill_tokens)`
              (the simulated engine's latency model) and pushes them back when they end
    learner   takes a batch when `try_get_batch` gives one, trains for `train_s(tokens)` (its rows'
              prompt + response tokens),
              then every engine loads the new weights (`update_s`; `interrupt` aborts and
              re-prefills what was running, `drain` finishes it first, `continue` keeps it),
              and the store's version moves on
    APRIL     with `early_stop`, the engines abort what they run as soon as a batch is taken
    shared    `shared_host_slowdown` F: engines and learner on one machine's cores slow each other
    host      (memory bandwidth, caches, the driver and store on the learner's core). A learner step
              that starts with an engine generating takes F times as long, and so do the engines'
              decode steps during it. F is measured on the learner side (an async run's seconds
              per token over a sync run's) and assumed the same for the engines. 1 (the default):
              accelerators of their own

Response lengths are drawn once per sample (a requeued sample gets the same length again, as the
simulated engine's seeded draw does). Pure Python: the latency model and length distribution are
passed in (async_april/launch/plan_command.py takes them from actors/engines/simulated.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from async_april.config import Config
from async_april.rollout.store import RolloutStore

BLOCK_DIVISOR = 8
"""As actors/engine.py ADMISSION_BLOCK_DIVISOR: a busy engine leases once this share of its slots is free."""


@dataclass(frozen=True)
class SimRow:
    prompt_ids: np.ndarray
    answer: str = ""
    extra: dict = field(default_factory=dict)


class SyntheticPrompts:
    """The store's dataset interface with every prompt `prompt_tokens` long (the planner has no data)."""

    def __init__(self, prompt_tokens: int):
        self._row = SimRow(np.ones(max(1, prompt_tokens), np.int64))

    def row(self, index: int) -> SimRow:
        return self._row


@dataclass
class _Running:
    sample: object
    left: int
    """Tokens this request still has to produce."""
    context: int
    base: int
    """Response tokens the sample had when leased (a resumed partial's)."""
    marks: list[tuple[int, int]]
    """(response token index, version) where a new weight version starts."""
    done: int = 0


class _Engine:
    def __init__(self, name: str, concurrency: int):
        self.name, self.concurrency = name, concurrency
        self.t = 0.0
        """Simulated time up to which this engine has been advanced."""
        self.running: list[_Running] = []
        self.prefill = 0
        self.version = 0
        self.open = True
        self.busy_s = self.generated = 0

    def free(self) -> int:
        return self.concurrency - len(self.running)


@dataclass
class SimResult:
    step_times: list[float]
    """Simulated wall time at the end of each learner step (weights loaded)."""
    trained_tokens: list[int]
    generated_tokens: int
    staleness: list[float]
    """Mean token staleness of each step's batch."""
    staleness_max: int
    engine_busy_s: float
    wasted_tokens: int
    wait_s: list[float]
    """Per step, how long the learner waited for its batch."""

    def useful_tokens_per_s(self, warmup: int) -> float:
        """Trained response tokens per second after `warmup` steps (the benchmarks' definition)."""
        w = min(warmup, len(self.step_times) - 1)
        t0 = self.step_times[w - 1] if w > 0 else 0.0
        return sum(self.trained_tokens[w:]) / max(1e-12, self.step_times[-1] - t0)

    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / max(1e-12, self.step_times[-1])


def simulate(cfg: Config, *, steps: int, engines: int, step_s: Callable[[int, int, int], float], update_s: float,
             train_s: Callable[[int], float], sample_length: Callable[[np.random.Generator], int],
             prompt_tokens: int, seed: int = 0, shared_host_slowdown: float = 1.0) -> SimResult:
    """Simulate `steps` learner steps of `cfg`'s rollout settings (batch_groups, n_samples, concurrency,
    max_new_tokens, eta, over_provision, early_stop, on_weight_update) with `engines` engines."""
    if not shared_host_slowdown >= 1.0:
        raise ValueError(f"shared_host_slowdown={shared_host_slowdown} must be >= 1 (1: no slowdown)")
    store = RolloutStore(cfg, SyntheticPrompts(prompt_tokens))  # type: ignore[arg-type]
    r = cfg.rollout
    policy, cap = r.on_weight_update, r.max_new_tokens
    rng = np.random.default_rng(seed)
    targets: dict[str, int] = {}
    pool = [_Engine(f"sim{i}", r.concurrency) for i in range(engines)]
    block = max(1, r.concurrency // BLOCK_DIVISOR)
    now, learner_done, batch_tokens = 0.0, math.inf, 0
    host = 1.0
    """The engines' and learner's cost multiplier now: shared_host_slowdown while both run."""
    starting: int | None = None
    """Prompt + response tokens of the batch just taken, until its step's end time is set."""
    batch_staleness: tuple[float, int] = (0.0, 0)
    out = SimResult([], [], 0, [], 0, 0.0, 0, [])
    wait_from, tried = 0.0, None
    n = r.n_samples
    held: dict[int, list[tuple[str, object]]] = {}

    def lease(e: _Engine) -> None:
        if not e.open or e.free() <= 0 or (e.running and e.free() < block):
            return
        for s in store.lease(e.name, e.free(), e.version):
            if s.uid not in targets:
                targets[s.uid] = min(cap, max(1, int(sample_length(rng))))
            ctx = len(s.prompt_ids) + s.num_tokens
            e.running.append(_Running(s, max(1, targets[s.uid] - s.num_tokens), ctx, s.num_tokens, [(s.num_tokens, e.version)]))
            e.prefill += ctx

    def chunk(e: _Engine) -> np.ndarray:
        """Cumulative cost of the decode steps until the next request ends (step_s is affine in batch tokens)."""
        b, k, t0 = len(e.running), min(x.left for x in e.running), sum(x.context for x in e.running)
        first = step_s(b, t0, 0)
        costs = first + (step_s(b, t0 + b, 0) - first) * np.arange(k, dtype=np.float64)
        costs[0] += step_s(0, 0, e.prefill) - step_s(0, 0, 0)
        return np.cumsum(costs) * host

    def advance(e: _Engine, until: float, finish_step: bool = False) -> None:
        """Decode on `e` up to simulated time `until`; with `finish_step`, the step under way then ends
        too (a forward pass once started runs to its end). Requests that end are pushed, and the
        engine leases more at once, as a generation actor does."""
        while e.running and e.t < until:
            cum = chunk(e)
            room = until - e.t
            # the tolerance: `until` is often this engine's own next event, e.t + cum[-1] rounded
            j = len(cum) if cum[-1] <= room * (1 + 1e-12) + 1e-12 else int(np.searchsorted(cum, room, "right"))
            if j < len(cum) and finish_step and (j == 0 or cum[j - 1] < room):
                j += 1
            if j == 0:
                return
            dt = float(cum[j - 1])
            e.t += dt
            e.busy_s += dt
            e.prefill = 0
            e.generated += j * len(e.running)
            for x in e.running:
                x.left -= j
                x.context += j
                x.done += j
            ended = [x for x in e.running if x.left <= 0]
            if ended:
                e.running = [x for x in e.running if x.left > 0]
                for x in ended:
                    held.setdefault(x.sample.prompt_index, []).append((e.name, finish(x, "length" if x.base + x.done >= cap else "stop")))
                    if len(held[x.sample.prompt_index]) == n:
                        flush(x.sample.prompt_index)
                lease(e)
            if j < len(cum):
                return
        if not e.running and until < math.inf:
            e.t = max(e.t, until)

    def flush(p: int | None = None) -> None:
        """Push the finished samples held back (of group `p`, or all). A finished sample changes nothing
        in the store until its group is complete, the version moves (which may retire its group) or an
        engine runs out of work (which may be waiting on it), so they are pushed then, one call per
        group: the store scans every open group on each push, and that is most of the planner's time."""
        for q in [p] if p is not None else list(held):
            by_engine: dict[str, list] = {}
            for name, smp in held.pop(q, []):
                by_engine.setdefault(name, []).append(smp)
            for name, smps in by_engine.items():
                store.push(name, smps)

    def finish(x: _Running, reason: str):
        s, n = x.sample, x.base + x.done
        versions = np.empty(n, np.int64)
        versions[: x.base] = s.versions[: x.base]
        for (start, v), nxt in zip(x.marks, x.marks[1:] + [(n, None)]):
            versions[start: nxt[0]] = v
        s.response_ids = np.zeros(n, np.int64)
        s.versions = versions
        s.behavior_logprobs = np.zeros(n, np.float32)
        s.finish_reason = reason
        if reason != "abort":
            s.reward = float(rng.random())  # distinct rewards: no group is filtered by dynamic sampling
        return s

    def abort_all(e: _Engine, early: bool) -> None:
        if e.running:
            store.push(e.name, [finish(x, "abort") for x in e.running], early_stop=early)
        e.running = []
        e.prefill = 0

    def next_event(e: _Engine) -> float:
        return e.t + float(chunk(e)[-1]) if e.running else math.inf

    while len(out.step_times) < steps:
        if held and any(not e.running for e in pool):
            flush()  # an idle engine may be waiting on them: a group past eta is requeued once none is leased
        for e in pool:
            if not e.running:
                e.t = max(e.t, now)
            elif e.open and e.free() >= block and e.t < now:
                advance(e, now, finish_step=True)  # new work joins between two decode steps
            lease(e)
        if starting is not None:  # a batch was just taken: does generation run beside its step?
            host = shared_host_slowdown if any(e.running for e in pool) else 1.0
            learner_done = now + train_s(starting) * host
            starting = None
        if learner_done == math.inf and (store.version, store.counters.started_groups, len(store.completed)) != tried:
            batch = store.try_get_batch()
            # nothing a batch depends on has changed since a failed try: do not ask again (a speed-up only)
            tried = (store.version, store.counters.started_groups, len(store.completed))
            if batch is not None:
                out.wait_s.append(now - wait_from)
                if r.early_stop:
                    for e in pool:
                        advance(e, now, finish_step=True)
                        abort_all(e, early=True)
                        e.t = max(e.t, now)
                toks = [s.model_versions for g in batch for s in g.samples]
                batch_tokens = sum(len(v) for v in toks)
                # the learner's cost runs over whole rows: prompt + response tokens
                learner_tokens = sum(len(s.prompt_ids) + s.num_tokens for g in batch for s in g.samples)
                lags = np.concatenate(toks) if toks else np.zeros(0, np.int64)
                lag = store.version - lags
                batch_staleness = (float(lag.mean()) if len(lag) else 0.0, int(lag.max()) if len(lag) else 0)
                starting = learner_tokens  # the step starts once the engines have leased what admission allows
                continue
        t_next = min([learner_done] + [next_event(e) for e in pool])
        if t_next == math.inf:
            raise RuntimeError("the simulation stalled: no engine has work and no batch can be formed "
                               f"(version {store.version}, {len(store.completed)} complete groups)")
        for e in pool:
            if e.running and next_event(e) <= t_next:
                advance(e, t_next)
        now = t_next
        if learner_done <= now:
            for e in pool:  # the decode steps beside the learner step, at the shared host's speed
                if e.running and host != 1.0:
                    advance(e, now)
            host = 1.0
            version = store.version + 1
            ends = []
            for e in pool:
                if policy == "drain":
                    e.open = False
                    advance(e, math.inf)
                    e.t = max(e.t, now)
                else:
                    advance(e, now, finish_step=True)
                    if policy == "interrupt":
                        abort_all(e, early=False)
                    e.t = max(e.t, now)
                e.t += update_s
                e.version = version
                for x in e.running:  # `continue`: tokens from here on are the new version's
                    x.marks.append((x.base + x.done, version))
                ends.append(e.t)
            now = max(ends)
            for e in pool:
                e.open = True
            flush()
            store.set_version(version)
            out.step_times.append(now)
            out.trained_tokens.append(batch_tokens)
            out.staleness.append(batch_staleness[0])
            out.staleness_max = max(out.staleness_max, batch_staleness[1])
            learner_done, wait_from = math.inf, now
    out.generated_tokens = sum(e.generated for e in pool)
    out.engine_busy_s = sum(e.busy_s for e in pool)
    out.wasted_tokens = int(sum(store.counters.wasted_tokens.values()))
    return out


def engine_ceiling(*, concurrency: int, step_s: Callable[[int, int, int], float], sample_length: Callable[[np.random.Generator], int],
                   max_new_tokens: int, prompt_tokens: int, requests: int = 0, seed: int = 0) -> float:
    """Tokens/s of one engine with `concurrency` requests always running (its steady state at full
    concurrency, as benchmarks/rollout_throughput.py measures it), over `requests` responses."""
    rng = np.random.default_rng(seed)
    requests = requests or 8 * concurrency
    left = [min(max_new_tokens, max(1, int(sample_length(rng)))) for _ in range(concurrency)]
    ctx = [prompt_tokens] * concurrency
    t, produced, started = 0.0, 0, concurrency
    prefill = prompt_tokens * concurrency
    while started < requests:
        k = min(left)
        b, t0 = len(left), sum(ctx)
        t += k * step_s(b, t0, 0) + (step_s(b, t0 + b, 0) - step_s(b, t0, 0)) * k * (k - 1) / 2
        t += step_s(0, 0, prefill) - step_s(0, 0, 0)
        produced += k * b
        prefill = 0
        for i in range(b):
            left[i] -= k
            ctx[i] += k
            if left[i] <= 0:
                left[i] = min(max_new_tokens, max(1, int(sample_length(rng))))
                ctx[i] = prompt_tokens
                prefill += prompt_tokens
                started += 1
    return produced / t
