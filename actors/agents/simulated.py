"""A tool-calling environment with a latency model, for multi-turn schedules at scale (no model, no tools).

`rollout.env=builtin:simulated_tool` on the simulated engine: every episode has
between `min_turns` and `max_turns` model turns (drawn from the response's seed);
after each turn the "tool" sleeps a latency drawn from `ToolLatency` (simulated
seconds times `time_scale`, the engine's `rollout.simulated_time_scale`) and
returns `obs_tokens` random token ids. The reward is a deterministic draw in
[0, 1] per turn, divided by the number of turns. Everything is a function of
(state, turn), so an interrupted step re-runs to the same result.

    rollout.agent.env_args: {median_s: 2.0, sigma: 1.0, max_s: 60.0, time_scale: 0.01,
                             min_turns: 2, max_turns: 6, obs_tokens: 64, vocab_size: 32000}
"""

from __future__ import annotations

import time

import numpy as np

from async_april.environment import EnvRow, Environment, Reset, Step
from actors.engines.simulated import ToolLatency


class SimulatedToolEnv(Environment):
    def __init__(self, tokenizer=None, *, median_s: float = 2.0, sigma: float = 1.0, max_s: float = 60.0,
                 time_scale: float = 0.01, min_turns: int = 2, max_turns: int = 6, obs_tokens: int = 64,
                 vocab_size: int = 32000) -> None:
        super().__init__(tokenizer)
        if not 1 <= min_turns <= max_turns:
            raise ValueError(f"simulated_tool: need 1 <= min_turns ({min_turns}) <= max_turns ({max_turns})")
        if time_scale < 0 or obs_tokens < 0 or vocab_size < 1:
            raise ValueError("simulated_tool: time_scale and obs_tokens must be >= 0 and vocab_size >= 1")
        self.latency = ToolLatency(median_s, sigma, max_s)
        self.time_scale, self.min_turns, self.max_turns = time_scale, min_turns, max_turns
        self.obs_tokens, self.vocab_size = obs_tokens, vocab_size
        self.sim_tool_s = 0.0
        """Simulated seconds spent in tool calls by this actor (re-runs after an interrupt included)."""

    def reset(self, row: EnvRow) -> Reset:
        rng = np.random.default_rng([row.seed, 0])
        return Reset(state={"seed": int(row.seed), "turn": 0,
                            "turns": int(rng.integers(self.min_turns, self.max_turns + 1))})

    def step(self, state: dict, turn_ids: np.ndarray) -> Step:
        turn = int(state["turn"])
        rng = np.random.default_rng([state["seed"], turn + 1])
        sim_s = self.latency.sample(rng)
        self.sim_tool_s += sim_s
        if self.time_scale > 0:
            time.sleep(sim_s * self.time_scale)
        nxt = dict(state, turn=turn + 1)
        reward = float(rng.random()) / state["turns"]
        if turn + 1 >= state["turns"]:
            return Step(np.zeros(0, np.int64), reward, True, nxt)
        return Step(rng.integers(0, self.vocab_size, self.obs_tokens, dtype=np.int64), reward, False, nxt)
