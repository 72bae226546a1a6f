"""Fixtures and helpers shared by the multi-turn tests (tests/test_agents.py, tests/test_agent_loops.py):
a random tiny model and its tokenizer, configs with an environment, the generation actor on a real
store in this process, and one episode run through the actor's turn loop."""

from __future__ import annotations

import numpy as np
import pytest

from actors.agents.env import EnvRow
from async_april.config import load_config
from async_april.data import PromptRow
from async_april.rollout.store import RolloutStore
from async_april.tasks.reverse_turns import make_turn_rows
from async_april.rollout.trajectory import Sample



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from async_april.models.tiny import build_random_tiny_model

    return str(build_random_tiny_model(tmp_path_factory.getbasetemp() / "agents-model", seed=3))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_cfg(model_dir, env, *extra):
    return load_config(None, [f"model.path={model_dir}", f"rollout.env={env}", "rollout.batch_groups=2",
                              "rollout.n_samples=2", "rollout.concurrency=8", "rollout.max_new_tokens=64",
                              "rollout.agent.max_turn_tokens=10", *extra])


def turn_rows(tokenizer, n, seed=5):
    return [PromptRow(prompt=r["prompt"], answer=r["answer"], prompt_ids=np.asarray(tokenizer(r["prompt"])["input_ids"]))
            for r in make_turn_rows(n, seed)]


class LocalStore:
    """A real RolloutStore reached the way the actor reaches the Ray actor (awaitable `.remote`
    calls), in this process; every push is recorded."""

    def __init__(self, store: RolloutStore):
        self.store, self.pushes, self.early_pushes = store, [], []
        self.lease_async = type("R", (), {"remote": staticmethod(self._lease)})()
        self.push_async = type("R", (), {"remote": staticmethod(self._push)})()

    async def _lease(self, actor_id, max_items, engine_version):
        return self.store.lease(actor_id, max_items, engine_version)

    async def _push(self, actor_id, samples, early_stop=False):
        import copy

        (self.early_pushes if early_stop else self.pushes).append(copy.deepcopy(samples))
        self.store.push(actor_id, samples, early_stop=early_stop)


def make_actor(cfg, model_dir, store=None):
    from actors.generation import GenerationActor

    return GenerationActor(cfg, "gen0", store, model_dir)


def fresh_sample(row: PromptRow, index=0) -> Sample:
    return Sample(prompt_index=index, sample_index=0, prompt_ids=np.asarray(row.prompt_ids, np.int64), answer=row.answer)


async def run_episode(actor, row: PromptRow) -> Sample:
    """Start the actor's engine, run one fresh episode of `row` through its turn loop, shut the engine down."""
    await actor.start()
    try:
        s = fresh_sample(row)
        await actor.agent.run(s, env_row(actor, s))
        return s
    finally:
        await actor.engine.shutdown()


def env_row(actor, s: Sample) -> EnvRow:
    from actors.generation import sampling_seed

    return EnvRow(prompt="", prompt_ids=s.prompt_ids, answer=s.answer, extra={}, seed=sampling_seed(0, s, resumable=False))
