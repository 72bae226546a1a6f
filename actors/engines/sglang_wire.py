"""What goes over HTTP to and from an SGLang 0.5.23 server: /generate replies, validated field by field,
per-token versions from `meta_info.weight_versions`, and weight buckets as `serialized_named_tensors`."""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
from typing import Any

import numpy as np

from actors.engine import GenerateResult, WeightBucket


class SGLangError(RuntimeError):
    """The SGLang server answered with an error or a malformed reply, or could not be reached within the retry limit."""


def json_object(text: str, what: str) -> dict:
    try:
        out = json.loads(text)
    except ValueError:
        raise SGLangError(f"{what}: the reply is not JSON: {text[:200]!r}") from None
    if not isinstance(out, dict):
        raise SGLangError(f"{what}: the reply is a JSON {type(out).__name__}, not an object")
    return out


def _field(obj: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, types):
        raise SGLangError(f"{where}.{key} is {value!r}; expected {getattr(types, '__name__', types)}")
    return value


def parse_generate_response(request_id: str, out: dict, sent_version: int, current_version: int,
                            prompt_tokens: int) -> GenerateResult:
    """SGLang /generate JSON -> GenerateResult, every field checked (SGLangError naming it).

    Each token is tagged with the version that produced it, from `meta_info.weight_versions`
    (0.5.23: spans [start, end) over the output tokens). Without spans, every token must come
    from `sent_version`: the reported `weight_version` must be it and no update ran since."""
    where = f"/generate reply for {request_id}: meta_info"
    meta = _field(out, "meta_info", dict, f"/generate reply for {request_id}")
    ids = _field(out, "output_ids", list, f"/generate reply for {request_id}")
    lps = _field(meta, "output_token_logprobs", list, where)
    if len(lps) != len(ids):
        raise SGLangError(f"{where}.output_token_logprobs has {len(lps)} entries for {len(ids)} output_ids; "
                          "was the request sent with return_logprob=true?")
    logprobs = np.empty(len(ids), np.float32)
    for i, (entry, tok) in enumerate(zip(lps, ids)):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise SGLangError(f"/generate reply for {request_id}: output_ids[{i}] is {tok!r}; expected a token id")
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SGLangError(f"{where}.output_token_logprobs[{i}] is {entry!r}; expected [logprob, token_id, text]")
        lp = entry[0]
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp) or lp > 0:
            raise SGLangError(f"{where}.output_token_logprobs[{i}][0] is {lp!r}; expected a finite logprob <= 0")
        if entry[1] != tok:
            raise SGLangError(f"{where}.output_token_logprobs[{i}] is for token {entry[1]!r} but output_ids[{i}] is {tok}")
        logprobs[i] = lp
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict) or reason.get("type") not in ("stop", "length", "abort"):
        raise SGLangError(f"{where}.finish_reason is {reason!r}; expected {{type: stop|length|abort, ...}}")
    versions = token_versions(meta, len(ids), sent_version, current_version, where)
    return GenerateResult(
        request_id=request_id,
        output_ids=np.asarray(ids, np.int64),
        logprobs=logprobs,
        versions=versions,
        finish_reason=reason["type"],
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
    )


def token_versions(meta: dict, n: int, sent_version: int, current_version: int, where: str) -> np.ndarray:
    """The policy version of each of `n` output tokens, from 0.5.23's weight_versions spans."""
    spans = meta.get("weight_versions")
    if not spans:
        reported = meta.get("weight_version")
        if reported not in (None, str(sent_version)) or current_version != sent_version:
            raise SGLangError(f"{where}: weights changed during the request (sent at version {sent_version}, reply "
                              f"says {reported!r}, now {current_version}) but the reply has no weight_versions spans; "
                              "cannot tell which tokens which weights produced")
        return np.full(n, sent_version, np.int64)
    out = np.empty(n, np.int64)
    pos = 0
    for k, span in enumerate(spans):
        if not isinstance(span, dict):
            raise SGLangError(f"{where}.weight_versions[{k}] is {span!r}; expected {{version, start, end}}")
        try:
            v, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            raise SGLangError(f"{where}.weight_versions[{k}] is {span!r}; expected integer version, start, end") from None
        # Versions only move forward, from the one the request was sent under (a server shared with another
        # client may be past this client's own version).
        if start != pos or end < start or end > n or v < (out[start - 1] if start else sent_version):
            raise SGLangError(f"{where}.weight_versions {spans!r} do not tile the {n} output tokens with versions "
                              f"rising from {sent_version}")
        out[start:end] = v
        pos = end
    if pos != n:
        raise SGLangError(f"{where}.weight_versions {spans!r} cover {pos} of {n} output tokens")
    return out


def serialize_named_tensors(bucket: WeightBucket) -> str:
    """One bucket as SGLang's `serialized_named_tensors` entry: base64 of the pickled [(name, tensor)] list.

    SGLang itself pickles with its MultiprocessingSerializer (shared-memory handles, same host only);
    plain CPU tensors pickled by value work through the same unpickler and across hosts.
    """
    buf = io.BytesIO()
    pickle.dump([(n, t.detach().cpu().contiguous()) for n, t in bucket.items()], buf)
    return base64.b64encode(buf.getvalue()).decode()


def deserialize_named_tensors(data: str) -> list[tuple[str, Any]]:
    return pickle.loads(base64.b64decode(data))
