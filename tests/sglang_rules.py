"""SGLang 0.5.23's request rules, ported for the STAND-IN server (tests/sglang_standin.py).

Pure functions, each a port of the upstream code it names (paths under sglang/srt/ of the
0.5.23 wheel), so the stand-in refuses, caps and tags exactly where the real server does:

- `verify_sampling_params`: sampling/sampling_params.py `SamplingParams.__post_init__` (the
  defaults and the temperature-0 / top_k=-1 special cases) and `SamplingParams.verify` (ranges);
- `check_lengths`: managers/tokenizer_manager.py `_validate_one_request` (input >= context_len,
  input + max_new_tokens > context_len), managers/scheduler.py `init_req_max_new_tokens` (the cap
  at max_req_len - input - 1) and managers/utils.py `validate_input_length` (max_req_input_len);
- `reported_spans`: utils/weight_versions.py `record_weight_version_events`,
  `compute_weight_version_spans`, `add_weight_versions_to_meta_info`, with the overlap
  scheduler's one-step lag (managers/scheduler.py `event_loop_overlap`, `pause_generation`);
- `SafeUnpickler`: utils/common.py `SafeUnpickler` (the allow-list every weight payload passes).
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import numpy as np

TOP_K_ALL = 1 << 30
"""sampling_params.py: top_k = -1 becomes the whole vocabulary."""
SAMPLING_EPS = 1e-6
"""sampling_params.py `_SAMPLING_EPS`: a temperature below it is greedy (top_k = 1, temperature 1)."""


def verify_sampling_params(sp: dict[str, Any], vocab_size: int) -> tuple[dict[str, Any], str | None]:
    """(the normalised params, None) or (_, the ValueError message SGLang answers with, as a 400)."""
    p = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
         "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "max_new_tokens": 128}
    p.update({k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"})
    # __post_init__: greedy, then top_k = -1 -> all (so verify's `top_k == -1` test only sees a -1 left by greedy: none)
    if 0 <= p["temperature"] < SAMPLING_EPS:
        p["temperature"], p["top_k"] = 1.0, 1
    if p["top_k"] == -1:
        p["top_k"] = TOP_K_ALL
    t = p["temperature"]
    if not math.isfinite(t) or t < 0.0:
        return p, f"temperature must be a non-negative finite number, got {t}."
    if not 0.0 < p["top_p"] <= 1.0:
        return p, f"top_p must be in (0, 1], got {p['top_p']}."
    if not 0.0 <= p["min_p"] <= 1.0:
        return p, f"min_p must be in [0, 1], got {p['min_p']}."
    if p["top_k"] < 1 or p["top_k"] == -1:
        return p, f"top_k must be -1 (disable) or at least 1, got {p['top_k']}."
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= p[key] <= 2.0:
            return p, f"{key} must be in [-2, 2], got {p[key]}."
    if not 0.0 < p["repetition_penalty"] <= 2.0:
        return p, f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p['repetition_penalty']}."
    if not 0 <= p["min_new_tokens"]:
        return p, f"min_new_tokens must be in [0, max_new_tokens], got {p['min_new_tokens']}."
    if p["max_new_tokens"] is not None:
        if p["max_new_tokens"] < 0:
            return p, f"max_new_tokens must be at least 0, got {p['max_new_tokens']}."
        if not p["min_new_tokens"] <= p["max_new_tokens"]:
            return p, (f"min_new_tokens must be in [0, max_new_tokens({p['max_new_tokens']})], got "
                       f"{p['min_new_tokens']}.")
    for token_id in p.get("logit_bias") or {}:
        if not 0 <= int(token_id) < vocab_size:
            return p, f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
    seed = p.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        return p, f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}."
    return p, None


def check_lengths(input_len: int, max_new_tokens: int | None, context_len: int) -> tuple[int, str | None]:
    """(max_new_tokens as the scheduler runs it, None) or (_, the 400 message).

    A KV pool large enough for one full-length request is assumed (max_req_len = context_len - 1,
    tp_worker.py); the stand-in has no pool of its own to size."""
    # tokenizer_manager.py _validate_one_request (allow_auto_truncate off, the default)
    if input_len >= context_len:
        return 0, f"The input ({input_len} tokens) is longer than the model's context length ({context_len} tokens)."
    if max_new_tokens is not None and max_new_tokens + input_len > context_len:
        return 0, (f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                   f"You requested a total of {max_new_tokens + input_len} tokens: {input_len} tokens from the "
                   f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                   "tokens in the input messages or the completion to fit within the limit.")
    max_req_len = context_len - 1  # tp_worker.py: min(context_len - 1, kv capacity - 1)
    max_req_input_len = max_req_len - 5
    # scheduler.py init_req_max_new_tokens: "keep this bound consistent with PrefillAdder's admission budget"
    capped = max(0, min(max_new_tokens if max_new_tokens is not None else 1 << 30, max_req_len - input_len - 1))
    if input_len >= max_req_input_len:  # utils.py validate_input_length
        return capped, (f"Input length ({input_len} tokens) exceeds the maximum allowed length ({max_req_input_len} "
                        "tokens). Use a shorter input or enable --allow-auto-truncate.")
    return capped, None


def reported_spans(true_versions: np.ndarray, lagged: set[int]) -> list[dict[str, Any]]:
    """The `weight_versions` spans SGLang reports for a request whose tokens truly came from
    `true_versions` (one per output token, non-decreasing).

    At each version change the scheduler records `len(req.output_ids)` for every live request
    (record_weight_version_events; none for a request without output yet). With the overlap
    scheduler a load while paused in place (or not paused) finds the last launched batch not yet
    processed: its token, sampled by the old weights, is not in output_ids, so the event counts
    one token short (`lagged`: the versions whose change was recorded that way)."""
    v = np.asarray(true_versions, np.int64)
    n = len(v)
    if n == 0:
        return []
    events: list[tuple[str, int]] = []
    for b in np.flatnonzero(np.diff(v)) + 1:  # first token of each new version
        count = int(b) - (1 if int(v[b]) in lagged else 0)
        if count > 0:  # record_weight_version_events: only requests with output_ids
            events.append((str(v[b - 1]), count))
    # compute_weight_version_spans
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (str(v[-1]), n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def _safe_load_torch_storage(data: bytes):
    import torch

    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class SafeUnpickler(pickle.Unpickler):
    """utils/common.py SafeUnpickler: exact (module, name) globals only. The entries a CPU tensor
    payload can need (builtins, containers, torch dtypes, storages, rebuild functions) are copied
    from upstream's ALLOWED_GLOBALS; the CUDA/NPU/sparse/SGLang-struct entries are left out, which
    makes this list stricter than upstream's, never looser."""

    ALLOWED_GLOBALS = {
        *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                                     "list", "range", "set", "slice", "str", "tuple")),
        ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
        ("collections", "Counter"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
        ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
        *(("torch", n) for n in ("bfloat16", "bool", "float", "float16", "float32", "float64", "half", "int",
                                 "int8", "int16", "int32", "int64", "long", "uint8", "double", "short")),
        ("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),
        *(("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                        "_rebuild_parameter", "_rebuild_parameter_with_state")),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.storage", "UntypedStorage"), ("torch.storage", "_UntypedStorage"), ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        *(("torch", n) for n in ("BFloat16Storage", "BoolStorage", "ByteStorage", "CharStorage", "DoubleStorage",
                                 "FloatStorage", "HalfStorage", "IntStorage", "LongStorage", "ShortStorage")),
    }

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_load_torch_storage  # torch's helper would run an unrestricted nested torch.load
        if (module, name) in self.ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def safe_loads(data: bytes) -> Any:
    """utils/common.py safe_pickle_loads / MultiprocessingSerializer.deserialize."""
    return SafeUnpickler(io.BytesIO(data)).load()


CONTROL_STRINGS = {
    "/update_weights_from_tensor": ("weight_version",),
    "/update_weights_from_disk": ("weight_version", "model_path"),
    "/update_weights_from_distributed": ("weight_version", "group_name"),
    "/init_weights_update_group": ("group_name", "master_address", "backend"),
    "/destroy_weights_update_group": ("group_name",),
    "/update_weight_version": ("new_version",),
}
"""managers/io_struct.py: the str (or Optional[str]) fields of each control body. FastAPI validates
the body against the struct, and a JSON int where a str goes is a 400 (http_server.py
validation_exception_handler turns FastAPI's 422 into 400)."""


def control_body_error(path: str, body: dict[str, Any]) -> str | None:
    for key in CONTROL_STRINGS.get(path, ()):
        if key in body and body[key] is not None and not isinstance(body[key], str):
            return f"1 validation error: {key}: Input should be a valid string, got {body[key]!r}"
    return None


RL_ON_POLICY_TARGET_CHOICES = ["fsdp"]
"""`--rl-on-policy-target` values of sglang 0.5.23 (srt/arg_groups/choices.py): `fsdp` swaps in the
trainer-matching RMSNorm, rotary, activation and log-softmax paths (srt/layers/layernorm.py, sampler.py)."""

DETERMINISTIC_ATTENTION_BACKEND_CHOICES = ["ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton"]
"""The attention backends 0.5.23 accepts with deterministic inference (srt/arg_groups/choices.py); any other
explicit `--attention-backend` raises ValueError at start (srt/arg_groups/overrides.py)."""
