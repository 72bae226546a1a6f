"""Generation: engines (SGLang included), multi-turn agents, staleness limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from async_april.config.base import Section


DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
"""The attention backends SGLang 0.5.23 runs deterministic inference with (srt/arg_groups/choices.py
DETERMINISTIC_ATTENTION_BACKEND_CHOICES); unset, it picks fa3 (Hopper and older) or flashinfer (Blackwell)."""


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to `flag` in a command line (`--flag v` or `--flag=v`), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


class SGLangConfig(Section):
    """How each generation actor runs (or reaches) its SGLang server; see docs/engines.md."""

    url: str | None = None
    """URL of a running server to attach to (one actor per server); None: each actor launches its own server on loopback."""
    tp_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel size of each server (`--tp-size`); `rollout.gpus_per_actor` must cover it. Weight payloads and the NCCL group count one rank per TP rank."""
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    """GPU memory fraction SGLang reserves for weights and KV cache (`--mem-fraction-static`); ~0.4 when the learner shares the GPU. None: SGLang's default."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `sglang.launch_server` flags, e.g. ["--attention-backend", "fa3"]. Flags this section sets itself are refused here, and with `deterministic` an --attention-backend SGLang refuses for deterministic inference (anything but ascend, fa3, fa4, flashinfer, intel_xpu, triton)."""
    port_range: tuple[int, int] = (30000, 30999)
    """Ports a launched server may take: each actor takes a free one of its own (held by a lock file, so actors on one node never share one)."""
    deterministic: bool = True
    """Per-request sampling seeds (reproducible samples): launch with `--enable-deterministic-inference`, without which SGLang ignores `sampling_seed`. False: no seeds are sent (faster kernels)."""
    launch_module: str = "sglang.launch_server"
    """Python module run as the server (`python -m MODULE --model-path ... --port ...`); a wrapper of your own, or the tests' stand-in."""
    startup_timeout_s: float = Field(900.0, gt=0.0)
    """Longest wait for a server's `/health` to answer 200 (loading a large model and capturing CUDA graphs takes minutes)."""
    request_timeout_s: float = Field(3600.0, gt=0.0)
    """Longest wait for one request before it counts as failed."""
    retries: int = Field(5, ge=0)
    """Retries with exponential backoff on connection errors before a clear error (never for `/generate`: a resend would sample a second response)."""

    @model_validator(mode="after")
    def _check(self) -> "SGLangConfig":
        lo, hi = self.port_range
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError(f"rollout.sglang.port_range {list(self.port_range)} must be [low, high] with 1024 <= low <= high <= 65535")
        owned = {"--model-path", "--host", "--port", "--tp-size", "--tp", "--mem-fraction-static", "--weight-version",
                 "--enable-deterministic-inference", "--skip-tokenizer-init", "--rl-on-policy-target"}
        for arg in self.extra_args:
            if arg.split("=", 1)[0] in owned:
                raise ValueError(f"rollout.sglang.extra_args sets {arg.split('=', 1)[0]}, which async-april sets itself; "
                                 "use the rollout.sglang key for it (tp_size, mem_fraction_static, deterministic, port_range; "
                                 "model.parity for --rl-on-policy-target) instead")
        backend = _flag_value(self.extra_args, "--attention-backend")
        if self.deterministic and backend is not None and backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            # The server would refuse it at start (sglang 0.5.23 srt/arg_groups/overrides.py _deterministic_attention_backend).
            raise ValueError(f"rollout.sglang.extra_args sets --attention-backend {backend}, which SGLang refuses with "
                             f"deterministic inference (rollout.sglang.deterministic, model.parity); use one of "
                             f"{', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}, or set rollout.sglang.deterministic=false")
        return self


class AgentConfig(Section):
    """Multi-turn rollouts with an environment (`rollout.env`); see docs/agents.md."""

    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's constructor (it is called as `Class(tokenizer=..., **env_args)`; an agent loop reads them as `ctx.args`); plain data only."""
    max_turns: int = Field(8, ge=1, le=10_000)
    """Most model turns per response; a response that reaches it without the environment saying done ends with reason `length`."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Longest single model turn in tokens (a longer turn is cut and handed to the environment as it is); None: whatever `rollout.max_new_tokens` leaves. The whole response (model and environment tokens together) is capped by `rollout.max_new_tokens`."""
    max_observation_tokens: int = Field(512, ge=0)
    """Longest observation the environment may append after one turn; a longer one is treated as a failed step (the environment's `on_failure` chooses what happens, counted in agent/step_failures)."""
    step_timeout_s: float = Field(30.0, gt=0.0, le=86400.0)
    """Longest one environment step (a tool call) may run; past it the step counts as failed and the environment's `on_failure` observation is used. The step's thread is left to finish on its own (Python threads cannot be killed)."""
    step_concurrency: int = Field(16, ge=1, le=4096)
    """Environment steps running at once per generation actor, each in a thread of its own off the generation loop; more wait their turn. A timed-out step frees its slot."""


MOVED_ROLLOUT_KEYS = {"sglang_url": "rollout.sglang.url", "request_timeout_s": "rollout.sglang.request_timeout_s",
                      "retries": "rollout.sglang.retries"}
"""Flat SGLang keys of earlier versions and where they live now."""


class RolloutConfig(Section):
    engine: Literal["torch", "sglang", "simulated"] = "torch"
    """Generation backend; see docs/engines.md."""
    num_actors: int = Field(1, ge=1, le=1024)
    """Generation actors (one engine each). A range `MIN-MAX` (e.g. `2-8`) makes rollout elastic: it starts MIN and sets `max_actors` to MAX; `auto` starts one and grows to `max_actors` (which it then needs). Saved as the two numbers."""
    max_actors: int | None = Field(None, ge=1, le=1024)
    """Elastic rollout: most generation actors. Between steps the pool starts more whenever the cluster has room for one (a node joined, placement.generation allows it), up to this; an actor lost with its node is replaced only when there is room, so the run shrinks instead of failing. Logged as rollout/actors_alive (running), rollout/actors (running plus pending) and rollout/actors_pending. None: fixed at `num_actors` (a lost actor is replaced, up to `max_actor_restarts`)."""
    gpus_per_actor: float = Field(0.0, ge=0.0, le=64.0)
    """GPUs Ray reserves for each generation actor (its engine; an SGLang server with tensor parallelism takes its tp size). 0 on CPU; fractions share a GPU with the learner."""
    batch_groups: int = Field(16, ge=1)
    """Prompts (groups) per learner step, B."""
    n_samples: int = Field(8, ge=1, le=1024)
    """Responses per prompt (group size n)."""
    max_new_tokens: int = Field(48, ge=1)
    """Longest response in tokens; longer ones finish with reason `length`."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature. The learner uses the same one for its logprobs."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling. Below 1 the recorded logprobs are not those of the sampled distribution (see docs)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling: -1 for off, else at least 1 (SGLang refuses 0: sampling_params.py `SamplingParams.verify`). Same caveat as `top_p`."""
    concurrency: int = Field(64, ge=1)
    """Requests in flight per engine."""
    max_batch_tokens: int = Field(8192, ge=16)
    """Torch engine: cap on tokens (prompt + generated) held by the running batch."""
    over_provision: float | Literal["auto"] = 1.0
    """APRIL: groups launched per batch as a multiple of `batch_groups` (1 to 64); the rest are aborted and resumed later. It also caps the groups in flight, so generation runs ahead by eta only with over_provision >= eta + 1. `auto`: tuned every step within `async.auto` (docs/async.md)."""
    early_stop: bool = False
    """APRIL: once a batch is complete, abort in-flight requests; their partials resume first with the next weights."""
    on_weight_update: Literal["interrupt", "drain", "continue"] = "drain"
    """On new weights: abort in-flight requests and resume them with the new weights (re-prefilling them), finish them first, or `continue`: load between decode steps and keep their KV cache (every engine; SGLang pauses in place and loads without a flush; see docs/async.md)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (counted) and replace them with new prompts."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """SGLang engine settings (ignored by the other engines)."""
    max_actor_restarts: int = Field(3, ge=0)
    """Times a dead generation actor is restarted (its leases go back to the store first), counted over the whole run (rebuilds from a checkpoint and resumed jobs continue the count); beyond that the run continues on the others."""
    simulated_lengths: str = "lognormal"
    """Simulated engine: response-length distribution (`lognormal`, `april`, `copris`, or a histogram file)."""
    simulated_time_scale: float = Field(0.01, ge=0.0, le=1.0)
    """Simulated engine: real seconds per simulated second (0.01 runs 100x faster than the modelled GPU)."""
    env: str | None = None
    """Multi-turn rollouts: the environment class, `module:Class` (runs that code), an agent loop `module:function` (`async def loop(ctx, row)`, actors/agents/loop.py) or a built-in (`builtin:reverse_turns`, `builtin:simulated_tool`, `builtin:calculator`); None: single-turn. With an environment the response interleaves model turns and environment observations (loss mask 0), and the sample's reward is the sum of the environment's step rewards (an agent loop's: what it adds and returns) (`reward.functions` are not used). See docs/agents.md."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Turn, token, timeout and concurrency limits of multi-turn rollouts (used only with `env`)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED_ROLLOUT_KEYS.items():
                if old in data:
                    raise ValueError(f"rollout.{old} has moved: set {new} instead")
        return data

    @model_validator(mode="before")
    @classmethod
    def _actor_range(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("num_actors"), str):
            return data
        value, data = data["num_actors"].strip(), dict(data)
        lo, sep, hi = value.partition("-")
        if value == "auto":
            if data.get("max_actors") is None:
                raise ValueError("rollout.num_actors=auto grows the pool to rollout.max_actors: set rollout.max_actors too")
            data["num_actors"] = 1
        elif sep and lo.strip().isdigit() and hi.strip().isdigit() and 1 <= int(lo) <= int(hi):
            data["num_actors"], data["max_actors"] = int(lo), int(hi)
        elif value.isdigit():
            data["num_actors"] = int(value)
        else:
            raise ValueError(f"rollout.num_actors must be an integer, a range `MIN-MAX` with 1 <= MIN <= MAX, or `auto` "
                             f"(with rollout.max_actors) (got {value!r})")
        return data

    @field_validator("over_provision", mode="before")
    @classmethod
    def _ratio_or_auto(cls, value: Any) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 1.0 <= value <= 64.0
        if value == "auto" or ok:
            return value
        raise ValueError(f"rollout.over_provision must be a number in [1, 64] or `auto` (got {value!r})")

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.top_k == 0:  # SGLang 0.5.23 answers every request with 400 (sampling/sampling_params.py verify)
            raise ValueError("rollout.top_k=0 is not a setting: use rollout.top_k=-1 for no top-k, or a value >= 1")
        if self.max_actors is not None and self.max_actors < self.num_actors:
            raise ValueError(f"rollout.max_actors={self.max_actors} is below rollout.num_actors={self.num_actors}; "
                             "set max_actors >= num_actors (or leave it unset for a fixed pool)")
        s = self.sglang
        if self.engine == "sglang" and s.url is None and s.tp_size > 1 and self.gpus_per_actor < s.tp_size:
            raise ValueError(f"rollout.sglang.tp_size={s.tp_size} needs rollout.gpus_per_actor >= {s.tp_size} "
                             f"(got {self.gpus_per_actor:g}): each actor's server spans tp_size GPUs")
        return self


class AutoStalenessConfig(Section):
    min: int = Field(0, ge=0, le=1000)
    """Lowest eta `auto` may choose; the run starts there."""
    max: int = Field(4, ge=0, le=1000)
    """Highest eta `auto` may choose."""
    min_ess: float | None = Field(0.9, gt=0.0, le=1.0)
    """Budget: lowest normalised effective sample size of the token IS weights pi_theta / pi_behav (mismatch/ess) a step may have; below it eta goes down. None: no ESS budget."""
    max_k3: float | None = Field(None, gt=0.0)
    """Budget: highest k3 KL(pi_behav || pi_theta) per token (mismatch/k3) a step may have; above it eta goes down. None: no KL budget."""
    raise_wait_frac: float = Field(0.1, ge=0.0, le=1.0)
    """Generation is the bottleneck when the learner waited for its batch (timing_s/rollout) at least this share of the summed step time (timing_s/step) of the last `raise_after` steps; only then does eta go up."""
    raise_after: int = Field(2, ge=1, le=1000)
    """Steps since the last change, each within budget, over which the learner's wait is judged (a window that slides; it starts empty after every change); when they were bottlenecked on generation a setting goes up one step (eta first, then over-provisioning; lowered in reverse), but not before eta + 1 steps (the regime in force trained) and, for a value that broke the budget n times before, raise_after x 2^n steps (back-off). After a lowering the budget is judged again only eta + 1 steps later."""
    over_provision_min: float = Field(1.0, ge=1.0, le=64.0)
    """Lowest `rollout.over_provision` that `auto` may choose; the run starts there."""
    over_provision_max: float = Field(4.0, ge=1.0, le=64.0)
    """Highest `rollout.over_provision` that `auto` may choose."""
    over_provision_step: float = Field(0.5, gt=0.0, le=64.0)
    """How much `auto` moves `rollout.over_provision` at a time."""

    @model_validator(mode="after")
    def _check(self) -> "AutoStalenessConfig":
        if self.min > self.max:
            raise ValueError(f"async.auto.min ({self.min}) must not exceed async.auto.max ({self.max})")
        if self.over_provision_min > self.over_provision_max:
            raise ValueError(f"async.auto.over_provision_min ({self.over_provision_min}) must not exceed "
                             f"async.auto.over_provision_max ({self.over_provision_max})")
        if self.min_ess is None and self.max_k3 is None:
            raise ValueError("async.auto needs a budget: set async.auto.min_ess or async.auto.max_k3")
        return self


class AsyncConfig(Section):
    max_staleness: int | Literal["auto"] = 0
    """eta: most policy versions a token may lag the learner; enforced by admission control. `auto`: tuned every step within `async.auto` (docs/async.md)."""
    auto: AutoStalenessConfig = Field(default_factory=AutoStalenessConfig)
    """Bounds and budget of `max_staleness: auto` and `rollout.over_provision: auto` (ignored otherwise)."""
    stale_policy: Literal["requeue", "drop"] = "requeue"
    """A group whose oldest token is past eta (rare: batches are chosen earliest deadline first), complete
    or still generating (then at once, as soon as none of its responses is in flight): regenerate it from
    its dataset row (requeue) or drop it; both counted in rollout/wasted_tokens/stale."""
    max_requeues: int = Field(2, ge=0, le=1000)
    """Times one prompt may be regenerated for staleness; past it the group is dropped (counted in
    rollout/groups_dropped_requeue_limit), so a prompt whose responses always outlast eta cannot loop."""

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _eta_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1000):
            return value
        raise ValueError(f"async.max_staleness must be an integer in [0, 1000] or `auto` (got {value!r})")

    @property
    def initial_staleness(self) -> int:
        """eta at the start of a run: the fixed value, or `auto.min`."""
        return self.auto.min if self.max_staleness == "auto" else self.max_staleness

    @property
    def max_lag(self) -> int:
        """The largest eta the run can have: lags 0..max_lag are reported separately."""
        return self.auto.max if self.max_staleness == "auto" else self.max_staleness
