"""GenerationActor: keeps `rollout.concurrency` requests in flight on one engine.

    store.lease ──> [request, request, ...] ──engine──> finished: score, push
         ^                                       └────> aborted:  push partial
         └──────── every completion frees a slot and leases the next piece of work

Every produced token keeps the logprob the engine recorded and the policy
version of the weights that produced it; a resumed response appends a new
segment to the partial one, so provenance survives any number of
interruptions. On new weights the actor either interrupts (abort in flight,
push partials, load, resume them first), drains (finish in flight with the
old weights, then load) or continues (the engine loads between two decode
steps and the requests in flight keep their KV cache), per
`rollout.on_weight_update`.

With `rollout.env` set, each leased sample runs as a multi-turn episode
(`actors/agents/runner.py`: model turns and environment steps, off this loop)
in place of one generate; aborts reach samples waiting on a step too.

A plain class; `train.py` wraps it with `ray.remote`. Its methods are async
and interleave on one event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from functools import partial


from actors.engine import ADMISSION_BLOCK_DIVISOR, GenerateRequest, SamplingParams
from async_april.config import Config
from async_april.rollout.trajectory import Sample

POLL_S = 0.02
"""How often an idle actor asks the store for work again (admission may reopen)."""
FLUSH_S = 0.05
"""A busy actor leases and pushes once a block of slots is free (ADMISSION_BLOCK_DIVISOR), and
otherwise pushes at most this long after its previous push."""


def stop_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """Every token that ends a response: the model's generation-config EOS set (a list for Qwen3:
    <|im_end|> and <|endoftext|>) plus the tokenizer's EOS, as the model's own `generate` stops."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(t) for t in ids))


def sampling_seed(run_seed: int, sample: Sample, resumable: bool = True, turn: int | None = None) -> int:
    """Per-request seed: reproducible whatever else shares the batch, new for each resume
    (or, with resumable=False, one per response: its identity across resumes; with `turn` too,
    one per model turn of a multi-turn response)."""
    ident = "response" if turn is None else f"turn{turn}"
    key = f"{run_seed}/{sample.prompt_index}/{sample.sample_index}/{sample.num_tokens if resumable else ident}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class GenerationActor:
    def __init__(self, cfg: Config, actor_id: str, store, model_path: str, engine=None):
        import torch
        from transformers import AutoTokenizer

        from actors.engines import make_engine
        from async_april.rewards.scoring import RewardScorer

        from async_april.models.paths import model_path_on_this_node

        torch.set_num_threads(1)
        self.cfg = cfg
        self.actor_id = actor_id
        self.store = store
        model_path = str(model_path_on_this_node(cfg.model, model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.stop_token_ids = stop_token_ids(model_path, self.tokenizer)
        self.engine = engine if engine is not None else make_engine(cfg, model_path)
        self.scorer = RewardScorer(cfg.reward)
        self.agent = None
        """Multi-turn rollouts (rollout.env): the turn loop that replaces a single generate."""
        self.inflight: dict[str, asyncio.Task] = {}
        self.open = asyncio.Event()
        """Set while run() may lease; cleared by an early stop or a weight load (see _close)."""
        self.open.set()
        self._closed = 0
        self.stopping = False
        self.aborting: set[str] = set()
        """Uids of requests an abort covers: one that has not reached the engine yet is not sent."""
        self.early: set[str] = set()
        """Uids aborted by an early stop: their partials wait for new weights (store.push early_stop)."""
        self.generated_tokens = 0
        self.outbox: list[tuple[Sample, bool]] = []
        """Samples returned by the engine, not yet pushed: (sample, aborted by an early stop)."""
        self.weight_load_s = 0.0
        self.resume_prefill_tokens = 0
        """Prompt + partial tokens sent again to resume aborted responses: re-prefill this actor asked for."""
        self.lease_block = max(1, cfg.rollout.concurrency // ADMISSION_BLOCK_DIVISOR)
        self._last_flush = 0.0
        if cfg.rollout.env is not None:
            from actors.agents.runner import build_agent

            self.agent, self.stop_token_ids = build_agent(cfg, self.tokenizer, self.engine, self._turn_request,
                                                          self.aborting, self.stop_token_ids)

    async def start(self) -> int:
        await self.engine.start()
        return self.engine.version

    def startup_note(self) -> str:
        """What the engine's start-up is waiting for, if it says (the SGLang engine does); answered while `start` runs."""
        return getattr(self.engine, "startup_note", "")

    def pin_cpus(self, cores: tuple[int, ...]) -> None:
        """Pin this actor's process, the engine's thread included, to `cores` (run.pin_cpus)."""
        from async_april.hosts.cpu_pinning import pin_process

        pin_process(cores)

    # -- the loop -------------------------------------------------------------
    async def run(self) -> None:
        """Lease, generate, push until `stop()`; returns only then (or raises)."""
        while not self.stopping:
            await self.open.wait()
            self._reap()
            free = self.cfg.rollout.concurrency - len(self.inflight)
            # Lease and push a block of slots at a time, not one per finished request: every store
            # call costs CPU on the learner's share, and engines admit new requests in blocks anyway.
            # A finished sample waits at most FLUSH_S, and never once the actor runs dry.
            lease_now = free >= self.lease_block or (free > 0 and not self.inflight)
            if lease_now or time.perf_counter() - self._last_flush >= FLUSH_S:
                await self._flush()  # the store hears of completions before it hands out more work
            if lease_now:
                for s in await self.store.lease_async.remote(self.actor_id, free, self.engine.version):
                    self.inflight[s.uid] = asyncio.create_task(self._generate(s))
            if self.inflight:
                await asyncio.wait(list(self.inflight.values()), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                self._reap()
            else:
                await asyncio.sleep(POLL_S)

    async def _generate(self, sample: Sample) -> None:
        if self.agent is not None:
            return await self._run_agent(sample)
        r = self.cfg.rollout
        remaining = r.max_new_tokens - sample.num_tokens
        if sample.uid in self.aborting:
            pass  # aborted before it reached the engine: handed back as it was leased
        elif remaining > 0:
            req = GenerateRequest(
                request_id=f"{self.actor_id}/{sample.uid}/r{sample.num_resumes}/",
                input_ids=sample.resume_input_ids(),
                prompt_len=len(sample.prompt_ids),
                response_seed=sampling_seed(self.cfg.run.seed, sample, resumable=False),
                sampling=SamplingParams(
                    max_new_tokens=remaining,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    stop_token_ids=self.stop_token_ids,
                    seed=sampling_seed(self.cfg.run.seed, sample),
                ),
            )
            if sample.num_tokens:
                self.resume_prefill_tokens += len(req.input_ids)
            res = await self.engine.generate(req)
            sample.extend(res.output_ids, res.logprobs, res.versions, res.finish_reason)
            self.generated_tokens += len(res.output_ids)
        else:
            sample.finish_reason = "length"
        if sample.done:
            sample.reward = await self._score(sample)
        self.outbox.append((sample, sample.uid in self.early))

    async def _run_agent(self, sample: Sample) -> None:
        """Multi-turn: the environment's turn loop (actors/agents/runner.py) in place of one generate;
        the reward is the sum of the environment's step rewards."""
        from async_april.environment import EnvRow

        if sample.uid not in self.aborting:
            if sample.num_tokens:  # a resume sends the whole context again
                self.resume_prefill_tokens += len(sample.prompt_ids) + sample.num_tokens
            before = sample.num_model_tokens
            row = EnvRow(prompt=self.tokenizer.decode(sample.prompt_ids, skip_special_tokens=True),
                         prompt_ids=sample.prompt_ids, answer=sample.answer or "", extra=dict(sample.extra),
                         seed=sampling_seed(self.cfg.run.seed, sample, resumable=False))
            await self.agent.run(sample, row)
            self.generated_tokens += sample.num_model_tokens - before
        if sample.done:
            sample.reward = sample.env_reward
            sample.reward_parts = {"env": sample.env_reward}
        self.outbox.append((sample, sample.uid in self.early))

    def _turn_request(self, sample: Sample, max_new_tokens: int, prompt_len: int, turn: int) -> GenerateRequest:
        """The engine request for model turn `turn` of a multi-turn sample (or its resume): everything
        so far as token ids. `prompt_len` (where this turn's context ends) and a per-turn response seed
        let the simulated engine keep each turn's drawn length across resumes."""
        r = self.cfg.rollout
        return GenerateRequest(
            request_id=f"{self.actor_id}/{sample.uid}/r{sample.num_resumes}/t{turn}/",
            input_ids=sample.resume_input_ids(),
            prompt_len=prompt_len,
            response_seed=sampling_seed(self.cfg.run.seed, sample, resumable=False, turn=turn),
            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    stop_token_ids=self.stop_token_ids, seed=sampling_seed(self.cfg.run.seed, sample)),
        )

    async def _score(self, sample: Sample) -> float:
        """Off the engine's path: a process pool when reward.num_workers > 0."""
        prompt = self.tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
        response = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        total, sample.reward_parts = await self.scorer.score_async(prompt, response, sample.answer or "", sample.extra)
        return total

    async def _settle(self, tasks: dict[str, asyncio.Task] | None = None) -> None:
        """Wait until `tasks` (default: every in-flight request, including any added meanwhile)
        have returned, then push what they produced."""
        while waiting := [t for t in (self.inflight if tasks is None else tasks).values() if not t.done()]:
            await asyncio.wait(waiting)
        self._reap()
        await self._flush()

    async def _abort_inflight(self) -> dict[str, asyncio.Task]:
        """Abort the requests in flight now and wait for exactly those. Work leased later (a lease
        already on its way when leasing closed) is neither aborted nor waited for."""
        tasks = dict(self.inflight)
        self.aborting.update(tasks)
        if self.agent is not None:
            self.agent.abort(tasks)  # samples waiting on an environment step leave now, the step pending
        try:
            await self.engine.abort_all()
            await self._settle(tasks)
        finally:
            self.aborting.difference_update(tasks)
        return tasks

    def _close(self) -> None:
        """Stop leasing until the matching _reopen (an early stop and a weight load may overlap)."""
        self._closed += 1
        self.open.clear()

    def _reopen(self) -> None:
        self._closed -= 1
        if self._closed == 0:
            self.open.set()

    def _reap(self) -> None:
        """Forget finished requests; re-raise the first failure (engine crash, reward with
        on_error=stop) so the actor dies and the controller returns its leases to the store.
        Only here are tasks removed, so no failure goes unseen."""
        failed = None
        for uid, task in list(self.inflight.items()):
            if task.done():
                del self.inflight[uid]
                if failed is None and not task.cancelled() and task.exception() is not None:
                    failed = task.exception()
        if failed is not None:
            raise failed

    async def _flush(self) -> None:
        """Push finished and aborted samples in one call per kind: one RPC per block, not per
        sample (an interrupt returns every in-flight request at once)."""
        self._last_flush = time.perf_counter()
        out, self.outbox = self.outbox, []
        for early in (False, True):
            batch = [s for s, e in out if e is early]
            if batch:
                await self.store.push_async.remote(self.actor_id, batch, early_stop=early)

    # -- control from the controller ------------------------------------------------
    async def update_weights(self, payload, version: int) -> float:
        """Load weights `version`: object-store bucket refs or a disk directory (see
        async_april/weights/buckets.py), fetched before the load. Returns seconds spent."""
        from async_april.weights.buckets import fetch_buckets

        in_flight = self.cfg.rollout.on_weight_update == "continue"
        if isinstance(payload, str) and getattr(self.engine, "weight_update_mode", None) == "disk":
            load = partial(self.engine.update_weights_from_disk, payload, version, in_flight=in_flight)  # the server reads the files
        elif in_flight:
            load = partial(self.engine.update_weights_in_flight, await fetch_buckets(payload), version)
        else:
            load = partial(self.engine.update_weights, await fetch_buckets(payload), version)
        return await self._load(load)

    async def init_weights_update_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str, backend: str = "nccl") -> None:
        """NCCL transport (SGLang engine): join the learner's broadcast group (`backend`: the learner's,
        weight_buckets.broadcast_backend); returns once every member joined."""
        if not hasattr(self.engine, "init_weights_update_group"):
            raise RuntimeError(f"weight_sync.transport=nccl needs rollout.engine=sglang; {type(self.engine).__name__} cannot join an NCCL group")
        self.engine.group_name = group_name
        await self.engine.init_weights_update_group(master_addr, master_port, rank_offset, world_size, backend)

    async def destroy_weights_update_group(self) -> None:
        """Leave the broadcast group (the set of engines changed: learners/weight_sync.py re-forms it)."""
        await self.engine.destroy_weights_update_group()

    def weight_group_member(self) -> str:
        """This actor's name for the weight group's membership (and a liveness probe before a broadcast)."""
        return self.actor_id

    async def update_weights_from_distributed(self, plan, version: int) -> float:
        """NCCL transport: announce each bucket (names, dtypes, shapes) while learner rank 0 broadcasts it."""

        announced = [([s.name for s in b], [s.dtype for s in b], [list(s.shape) for s in b]) for b in plan]
        in_flight = self.cfg.rollout.on_weight_update == "continue"
        return await self._load(partial(self.engine.update_weights_from_distributed, announced, version, in_flight=in_flight))

    async def _load(self, load) -> float:
        """Per rollout.on_weight_update: `continue` loads at once (nothing is aborted or awaited, leasing
        stays open; the engine applies the weights between two decode steps and the requests in flight
        go on with their KV cache); `interrupt` and `drain` close leasing, abort or finish what is in
        flight, load, and reopen. Returns the seconds spent."""
        t0 = time.perf_counter()
        if self.cfg.rollout.on_weight_update == "continue":
            await load()
        else:
            self._close()
            try:
                if self.cfg.rollout.on_weight_update == "interrupt":
                    while self.inflight:  # a lease on its way when leasing closed lands at most once more
                        await self._abort_inflight()
                await self._settle()
                await load()
            finally:
                self._reopen()
        self.weight_load_s = time.perf_counter() - t0
        return self.weight_load_s

    async def early_stop(self) -> None:
        """APRIL: the batch is complete; abort what is in flight, partials wait for new weights.
        Waits only for the requests it aborts, with leasing closed meanwhile: the controller blocks
        on this call, and work that starts after the abort must not hold the learner up."""
        self._close()
        snapshot = set(self.inflight)
        self.early.update(snapshot)
        try:
            await self._abort_inflight()
        finally:
            self.early.difference_update(snapshot)
            self._reopen()

    async def stop(self) -> None:
        self.stopping = True
        await self.engine.abort_all()
        await self._settle()
        self.scorer.close()

    def metrics(self) -> dict[str, float]:
        st = self.engine.stats()
        total = st.busy_s + st.idle_s
        return {
            "rollout/inflight": len(self.inflight),
            "rollout/reward_errors": self.scorer.errors,
            "perf/engine_busy_s": st.busy_s,
            "perf/engine_idle_s": st.idle_s,
            "perf/engine_idle_frac": st.idle_s / total if total > 0 else 0.0,
            "perf/engine_generated_tokens": st.generated_tokens,
            "perf/engine_batch_rows": st.batch_rows,
            "perf/engine_batch_capacity": st.batch_capacity,
            "perf/engine_kv_slots": st.kv_slots,
            "perf/engine_kv_pad_slots": st.kv_pad_slots,
            # Re-prefill asked for by resumes (any engine) plus caches an engine rebuilt itself.
            "rollout/reprefill_tokens": self.resume_prefill_tokens + st.reprefill_tokens,
            **(self.agent.metrics() if self.agent is not None else {}),
        }

    def version(self) -> int:
        return self.engine.version
