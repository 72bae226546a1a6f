"""Multi-turn rollouts: environments (env.py), the turn loop (runner.py), chat-template turn markers
(chat.py) and a latency-model tool environment for benchmarks (simulated.py). docs/agents.md."""

from actors.agents.env import EnvRow, EnvSpecError, Environment, Reset, Step, load_env_class, make_env

__all__ = ["EnvRow", "EnvSpecError", "Environment", "Reset", "Step", "load_env_class", "make_env"]
