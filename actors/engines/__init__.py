"""Generation backends behind one `Engine` protocol; `make_engine` picks one from the config.

    torch      engines/torch_engine.py  continuous batching on a transformers causal LM (CPU/CUDA)
    sglang     engines/sglang_engine.py HTTP client for SGLang 0.5.x (launched on loopback or at a URL);
               sglang_wire.py (replies, weight buckets), sglang_process.py (ports, processes)
    simulated  engines/simulated.py     latency model + response-length distribution, no weights

Backends are imported lazily, so choosing `simulated` never imports torch models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from actors.engine import Engine
    from async_april.config import Config


SGLANG_UPDATE_MODE = {"object_store": "tensor", "disk": "disk", "nccl": "distributed"}
"""weight_sync.transport -> the SGLang route that loads the weights."""


def make_engine(
    cfg: "Config",
    model_path: str,
    *,
    device: str | None = None,
    eos_token_ids: Iterable[int] | None = None,
    version: int = 0,
    **overrides: Any,
) -> "Engine":
    """Build the engine named by `cfg.rollout.engine` (not started: await `engine.start()`).

    model_path: a resolved Hugging Face model directory (builtin paths resolved by the caller).
    device: torch engine only; None picks cuda when available.
    eos_token_ids: torch engine default stop tokens; None reads the model's generation config.
    overrides: extra constructor keywords for the chosen backend (e.g. `time_scale` for simulated,
    `sampling_overrides` for sglang).
    """
    r = cfg.rollout
    kind = r.engine
    if kind == "torch":
        import torch

        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(
            model_path,
            device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
            dtype=cfg.model.dtype,
            attn_implementation=cfg.model.attn_implementation,
            max_running=r.concurrency,
            max_batch_tokens=r.max_batch_tokens,
            eos_token_ids=eos_token_ids,
            version=version,
            parity=cfg.model.parity,
            **overrides,
        )
    if kind == "sglang":
        from actors.engines.sglang_engine import SGLangEngine

        s = r.sglang
        kw = {"tp_size": s.tp_size, "mem_fraction_static": s.mem_fraction_static, "extra_args": s.extra_args,
              "port_range": s.port_range, "deterministic": s.deterministic, "launch_module": s.launch_module,
              "rl_on_policy_target": "fsdp" if cfg.model.parity else None,
              "startup_timeout_s": s.startup_timeout_s, "request_timeout_s": s.request_timeout_s, "retries": s.retries,
              "temperature": r.temperature, "weight_update_mode": SGLANG_UPDATE_MODE[cfg.weight_sync.transport],
              "in_flight_updates": r.on_weight_update == "continue", **overrides}
        return SGLangEngine(model_path, url=s.url, version=version, **kw)
    if kind == "simulated":
        from actors.engines.simulated import SimulatedEngine

        kw = {"time_scale": r.simulated_time_scale, **overrides}
        return SimulatedEngine(r.simulated_lengths, max_running=r.concurrency, version=version, **kw)
    raise ValueError(f"rollout.engine={kind!r}: expected torch, sglang or simulated")


__all__ = ["make_engine"]
