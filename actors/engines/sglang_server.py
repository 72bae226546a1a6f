"""What the SGLang 0.5.23 server we talk to allows, read from its `/server_info` (the resolved server
args plus the scheduler's limits: srt/utils/common.py `build_server_info`): whether it is the server we
mean, whether in-flight weight updates tag tokens right on it, and how long a request may be.
Paths under sglang/srt/ of the 0.5.23 wheel."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from actors.engines.sglang_wire import SGLangError

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""Set to 1/true, SGLang reports logprobs before temperature scaling (srt/layers/sampler.py)."""


def original_logprob_env_error(temperature: float, env: dict[str, str] | None = None) -> str | None:
    """Why this environment would make SGLang's logprobs wrong for us, or None.

    We need log_softmax(logits / T): the behaviour policy's. With the variable set SGLang reports
    log_softmax(logits), which at T != 1 biases every importance weight without any error."""
    value = (os.environ if env is None else env).get(ORIGINAL_LOGPROB_ENV, "")
    if value.strip().lower() in ("1", "true", "yes", "on") and temperature != 1.0:
        return (f"{ORIGINAL_LOGPROB_ENV}={value} makes SGLang report logprobs before temperature scaling, but "
                f"rollout.temperature={temperature:g}: the recorded behaviour logprobs would be wrong; unset "
                f"{ORIGINAL_LOGPROB_ENV} (or use rollout.temperature=1)")
    return None


IN_FLIGHT_FLAGS = ("--disable-overlap-schedule", "--disable-radix-cache")
"""Launch flags rollout.on_weight_update=continue needs (srt/arg_groups/fields/schedule.py, memory.py).
The overlap scheduler leaves the last launched decode batch unprocessed at an in-place pause, so the
version change is recorded one token short per running request and not at all for a request whose
first token is still pending (managers/scheduler.py event_loop_overlap, pause_generation;
utils/weight_versions.py record_weight_version_events): old-weights tokens tagged new. The radix cache
keeps serving prefix KV computed by older weights (a load with flush_cache=false leaves the tree, and
a flush is refused while requests run: scheduler.py flush_cache), so a later request's prompt KV can
be any number of versions old while all its tokens are tagged with the newest."""


def in_flight_problem(info: dict[str, Any] | None, url: str) -> str | None:
    """Why in-flight updates (continue) would mis-tag tokens on this server, or None."""
    if info is None:
        return (f"{url} has no /server_info, so it cannot be shown to run with {' '.join(IN_FLIGHT_FLAGS)}, which "
                "rollout.on_weight_update=continue needs; use rollout.on_weight_update=interrupt or drain")
    missing = [f for f in IN_FLIGHT_FLAGS if info.get(f.removeprefix("--").replace("-", "_")) is not True]
    if not missing:
        return None
    return (f"the SGLang server at {url} runs without {' '.join(missing)}: with rollout.on_weight_update=continue its "
            "overlap scheduler tags one old-weights token per running request with the new version and its radix "
            "cache serves prompt KV of older weights (docs/engines.md); restart it with "
            f"{' '.join(IN_FLIGHT_FLAGS)}, or use rollout.on_weight_update=interrupt or drain")


def check_server_info(info: dict[str, Any], url: str, *, port: int | None, tp_size: int, deterministic: bool,
                      rl_on_policy_target: str | None = None) -> None:
    """The answering server is the one we mean: `port` (ours, when we launched it), our tp size, seed
    handling when we send seeds, and (model.parity) SGLang's on-policy kernels."""
    if port is not None and info.get("port") not in (None, port):
        raise SGLangError(f"{url}/server_info reports port {info.get('port')}, not {port}: not our server")
    tp = info.get("tp_size")
    if tp is not None and int(tp) != tp_size:
        raise SGLangError(f"the server at {url} runs tp_size {tp} but rollout.sglang.tp_size={tp_size}; "
                          "weight payloads carry one entry per TP rank, so set them equal")
    if deterministic and info.get("enable_deterministic_inference") is False:
        raise SGLangError(f"the server at {url} runs without --enable-deterministic-inference, so it would "
                          "ignore sampling_seed; restart it with that flag or set rollout.sglang.deterministic=false")
    if rl_on_policy_target is not None and info.get("rl_on_policy_target", rl_on_policy_target) != rl_on_policy_target:
        raise SGLangError(f"the server at {url} runs with rl_on_policy_target={info.get('rl_on_policy_target')}, but "
                          f"model.parity needs {rl_on_policy_target!r} (its trainer-matching RMSNorm, rotary, activation "
                          f"and log-softmax); restart it with --rl-on-policy-target {rl_on_policy_target} or set model.parity=false")


@dataclass(frozen=True)
class ContextLimits:
    """The request lengths a server takes. `max_req_input_len` is the scheduler's (max_req_len - 5,
    where max_req_len = min(context_len - 1, KV pool - 1): managers/tp_worker.py); an input that long
    is refused (managers/utils.py validate_input_length), and max_new_tokens is capped at
    max_req_len - input - 1 (scheduler.py init_req_max_new_tokens), which also keeps input +
    max_new_tokens within context_len (tokenizer_manager.py _validate_one_request refuses more)."""

    max_req_input_len: int
    context_len: int

    @classmethod
    def from_server_info(cls, info: dict[str, Any] | None) -> "ContextLimits | None":
        m = (info or {}).get("max_req_input_len")
        if not isinstance(m, int) or isinstance(m, bool):
            return None  # an older server: it reports no limits, and requests go out as asked
        c = (info or {}).get("context_length")
        return cls(m, c if isinstance(c, int) and not isinstance(c, bool) else m + 6)

    def max_new_tokens(self, input_len: int, prompt_len: int | None, asked: int, url: str) -> int:
        """What to ask for: `asked` capped to what the server would run; 0 when the input leaves no room
        (nothing to send: the response ends with reason `length`), as for a resume or a multi-turn context
        that reached the limit (their callers set `prompt_len`; the generation actor always does, and
        data.max_prompt_len keeps its prompts short). An input given as all prompt (`prompt_len` None)
        that the server would refuse is an SGLangError naming the settings."""
        if input_len >= self.max_req_input_len:
            if prompt_len is not None:
                return 0
            raise SGLangError(
                f"a prompt of {prompt_len} tokens does not fit the SGLang server at {url}: it refuses inputs of "
                f"{self.max_req_input_len} tokens or more (context length {self.context_len}); lower "
                f"data.max_prompt_len below {self.max_req_input_len}, or serve the model with a longer --context-length")
        return max(0, min(asked, self.max_req_input_len + 5 - input_len - 1))
