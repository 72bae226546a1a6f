"""EvalActor: evaluates one policy version on the held-out sets, beside training, never for it.

    evaluate(weights, version):  [lock] load `version` -> every prompt x (`eval.samples` sampled
                                 + 1 greedy) through the engine, `eval.concurrency` in flight
                                 -> score (the run's reward functions) -> SetResult per set

With `rollout.env` each response is an episode through the same turn loop and environment as
training's (actors/agents/runner.py), scored by the environment's reward.

It is a generation actor of its own kind: the same engines (`make_engine`), tokenizer and reward
scorer as `GenerationActor`, but it never talks to the rollout store, so its samples cannot be
trained or enter the store's accounting. Weights reach it only through `evaluate`, under a lock, so
one evaluation sees one version from its first token to its last (checked on every token).

On a CPU machine it lowers its own priority (`eval.nice`, 19 by default) before its engine thread
starts: training's engine and learner keep their cores, and evaluation runs on the time they leave
idle. A plain class: `async_april/evaluation.py` wraps it with `ray.remote`; `async-april eval`
runs it in-process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import numpy as np

from actors.engine import GenerateRequest, SamplingParams
from actors.generation import stop_token_ids
from async_april.config import Config
from async_april.evaluation import EvalSet, SetResult
from async_april.rollout.trajectory import Sample


def lower_priority(nice: int) -> None:
    """Linux nice `nice` for every thread of this process (nice is per thread on Linux; threads started
    later inherit it from the thread that starts them). Raising it needs no privilege."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), max(nice, os.getpriority(os.PRIO_PROCESS, int(tid))))
        except OSError:  # a thread that ended meanwhile
            pass


def _check_versions(versions: np.ndarray, version: int) -> None:
    if len(versions) and (versions != version).any():
        raise RuntimeError(f"evaluation at version {version} got tokens of versions {sorted(set(versions.tolist()))}; "
                           "weights changed during an evaluation")


def eval_seed(run_seed: int, set_name: str, prompt: int, sample: int, tokens_so_far: int = 0) -> int:
    """The same seed for a prompt's k-th sample at every version: evaluations differ by the policy only.
    `tokens_so_far` > 0: a later model turn of a multi-turn episode."""
    key = f"{run_seed}/eval/{set_name}/{prompt}/{sample}{f'/{tokens_so_far}' if tokens_so_far else ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class EvalActor:
    def __init__(self, cfg: Config, model_path: str, sets: list[EvalSet], nice: int | None = None, version: int = 0):
        """`nice`: None uses eval.nice; `version`: the policy version of the weights at `model_path`."""
        import torch
        from transformers import AutoTokenizer

        from actors.engines import make_engine
        from async_april.models.paths import hub_pin, model_path_on_this_node
        from async_april.rewards.scoring import RewardScorer

        if hub_pin(cfg.model.path, model_path) is not None:  # the pinned hub commit, from this node's own cache
            model_path = str(model_path_on_this_node(cfg.model, model_path))
        lower_priority(cfg.eval.nice if nice is None else nice)
        torch.set_num_threads(1)
        self.cfg, self.sets = cfg, sets
        self.sets_by_name = {s.name: s for s in sets}
        ecfg = cfg.model_copy(deep=True)
        ecfg.rollout.concurrency = cfg.eval.concurrency
        self.engine = make_engine(ecfg, model_path, version=version)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.scorer = RewardScorer(cfg.reward)
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        self.stop_token_ids = stop_token_ids(model_path, self.tokenizer)  # as training's responses stop
        self.agent = None
        """Multi-turn (rollout.env): held-out episodes run through the same turn loop as training's."""
        if cfg.rollout.env is not None:
            from actors.agents.runner import build_agent

            ecfg.rollout.max_new_tokens = self.max_new_tokens  # the runner's budget for the whole response
            self.agent, self.stop_token_ids = build_agent(ecfg, self.tokenizer, self.engine, self._turn_request,
                                                          set(), self.stop_token_ids)
        self.lock = asyncio.Lock()
        self.started = False
        self.last_s = 0.0

    async def start(self) -> int:
        """Start the engine (once; `evaluate` waits for it, so the controller never has to)."""
        async with self.lock:
            await self._start()
        return self.engine.version

    async def _start(self) -> None:
        if not self.started:
            await self.engine.start()
            self.started = True

    async def evaluate(self, weights, version: int) -> list[SetResult]:
        """Load `weights` (object-store bucket refs or a disk directory, as async_april/weights/buckets.py defines
        them; None keeps the engine's weights) as `version`, then evaluate every set at that version."""
        from async_april.weights.buckets import fetch_buckets

        async with self.lock:
            t0 = time.perf_counter()
            await self._start()
            try:
                if weights is not None:
                    await self.engine.update_weights(await fetch_buckets(weights), version)
                out = [await self._evaluate_set(s, version) for s in self.sets]
            except asyncio.CancelledError:  # superseded (ray.cancel): free the engine for the next one
                await self.engine.abort_all()
                raise
            self.last_s = time.perf_counter() - t0
            return out

    async def _evaluate_set(self, s: EvalSet, version: int) -> SetResult:
        e = self.cfg.eval
        n, width = e.samples, e.samples + int(e.greedy)
        gate = asyncio.Semaphore(e.concurrency)
        jobs = [self._one(gate, s, p, j, version) for p in range(len(s.rows)) for j in range(width)]
        done = await asyncio.gather(*jobs)
        reward = np.array([d[0] for d in done], np.float64).reshape(len(s.rows), width)
        length = np.array([d[1] for d in done], np.int64).reshape(len(s.rows), width)
        trunc = np.array([d[2] for d in done], bool).reshape(len(s.rows), width)
        return SetResult(s.name, version, reward[:, :n], length[:, :n], trunc[:, :n],
                         reward[:, n] if e.greedy else None)

    def _sampling(self, s: EvalSet, p: int, j: int, max_new_tokens: int, tokens_so_far: int = 0) -> SamplingParams:
        """Sample `j` of prompt `p` (j == eval.samples: the greedy one), from `tokens_so_far` into the response."""
        e = self.cfg.eval
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if j == e.samples else e.temperature,
                              stop_token_ids=self.stop_token_ids,
                              seed=eval_seed(self.cfg.run.seed, s.name, p, j, tokens_so_far))

    async def _one(self, gate: asyncio.Semaphore, s: EvalSet, p: int, j: int, version: int) -> tuple[float, int, bool]:
        """One response to prompt `p` of set `s`: sample `j` (j == eval.samples: the greedy one)."""
        if self.agent is not None:
            async with gate:
                return await self._episode(s, p, j, version)
        row = s.rows[p]
        async with gate:
            res = await self.engine.generate(GenerateRequest(
                request_id=f"eval/v{version}/{s.name}/{p}/{j}/", input_ids=row.prompt_ids,
                sampling=self._sampling(s, p, j, self.max_new_tokens)))
        if res.finish_reason == "abort":
            raise asyncio.CancelledError  # only cancel() aborts this engine's requests
        _check_versions(res.versions, version)
        prompt = self.tokenizer.decode(row.prompt_ids, skip_special_tokens=True)
        response = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        reward, _ = await self.scorer.score_async(prompt, response, row.answer, row.extra)
        return float(reward), len(res.output_ids), res.finish_reason == "length"

    async def _episode(self, s: EvalSet, p: int, j: int, version: int) -> tuple[float, int, bool]:
        """A multi-turn response: the environment's reward, the model tokens' count, cut by a limit."""
        from async_april.environment import EnvRow

        row = s.rows[p]
        sample = Sample(prompt_index=p, sample_index=j, prompt_ids=np.asarray(row.prompt_ids, np.int64),
                        answer=row.answer, extra={"eval_set": s.name})
        env_row = EnvRow(prompt=self.tokenizer.decode(row.prompt_ids, skip_special_tokens=True), prompt_ids=sample.prompt_ids,
                         answer=row.answer or "", extra=dict(row.extra), seed=eval_seed(self.cfg.run.seed, s.name, p, j))
        await self.agent.run(sample, env_row)
        if sample.finish_reason == "abort":
            raise asyncio.CancelledError
        _check_versions(sample.model_versions, version)
        return float(sample.env_reward), sample.num_model_tokens, sample.finish_reason == "length"

    def _turn_request(self, sample: Sample, max_new_tokens: int, prompt_len: int, turn: int) -> GenerateRequest:
        """The turn loop's request for model turn `turn` of an evaluation episode: the whole context as ids."""
        s = self.sets_by_name[sample.extra["eval_set"]]
        return GenerateRequest(
            request_id=f"eval/v{self.engine.version}/{s.name}/{sample.prompt_index}/{sample.sample_index}/t{turn}/",
            input_ids=sample.resume_input_ids(), prompt_len=prompt_len,
            sampling=self._sampling(s, sample.prompt_index, sample.sample_index, max_new_tokens, sample.num_tokens))

    def versions(self) -> int:
        return self.engine.version

    async def stop(self) -> None:
        await self.engine.abort_all()
        self.scorer.close()
