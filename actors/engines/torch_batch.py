"""The torch engine's tensor operations: a left-padded KV batch and its prefill, sampling, weight staging.

Pure functions over tensors (and a model's parameters), so actors/engines/torch_engine.py keeps only
its loop. The running batch is a `DynamicCache` ([B, H, T, D] per layer) plus a [B, T] attention mask,
both left-padded: new rows are merged by left-padding whichever side is shorter, finished rows are
dropped with `index_select` and all-pad leading columns trimmed.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from actors.engine import SamplingParams, WeightBucket
from async_april.parity.kernels import log_softmax
from async_april.weights.lora import is_adapter_name, merge_lora, pair_adapters


def lpad(x: torch.Tensor, T: int, dim: int = 2) -> torch.Tensor:
    """Left-pad `x` with zeros along `dim` to length T."""
    n = T - x.shape[dim]
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim)


def left_padded(seqs: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as one left-padded [B, T] batch and its attention mask, on `device`."""
    T = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, T - len(x) :] = torch.as_tensor(np.asarray(x, np.int64))
        mask[i, T - len(x) :] = 1
    return ids.to(device), mask.to(device)


def prefill(model: torch.nn.Module, seqs: list[np.ndarray], device, cache_kw: str):
    """One forward over `seqs` as a left-padded batch into a fresh `DynamicCache`; position ids count
    each row's real tokens, so padding never changes its numbers. Returns (output, cache, mask);
    the output keeps the last position's logits only."""
    from transformers import DynamicCache

    ids, mask = left_padded(seqs, device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    return out, cache, mask


def merge_kv(cache, mask: torch.Tensor, new_cache, new_mask: torch.Tensor) -> torch.Tensor:
    """Append the rows of `new_cache` to `cache` in place (each side left-padded to the longer one);
    returns the merged mask."""
    T = max(mask.shape[1], new_mask.shape[1])
    for old, new in zip(cache.layers, new_cache.layers):
        old.keys = torch.cat([lpad(old.keys, T), lpad(new.keys, T)], 0)
        old.values = torch.cat([lpad(old.values, T), lpad(new.values, T)], 0)
    return torch.cat([lpad(mask, T, dim=1), lpad(new_mask, T, dim=1)], 0)


def select_kv(cache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep rows `keep` of `cache` in place and trim the columns that are padding in every kept row;
    returns the kept rows' mask."""
    idx = torch.tensor(keep, device=mask.device)
    mask = mask.index_select(0, idx)
    lead = int((mask.sum(0) == 0).long().cumprod(0).sum())  # all-pad leading columns
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, idx)[:, :, lead:]
        layer.values = layer.values.index_select(0, idx)[:, :, lead:]
    return mask[:, lead:]


def top_k_top_p(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p on one row of logprobs; removed entries become -inf (sampling only)."""
    out = logp
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, descending=True)
        cum = sorted_lp.exp().cumsum(0)
        drop = cum - sorted_lp.exp() > top_p  # keep the smallest prefix reaching top_p
        out = out.clone()
        out[order[drop]] = float("-inf")
    return out


def sample_next(logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator],
                parity: bool = False) -> tuple[list[int], list[float]]:
    """One token per row of `logits` ([B, V]) and its logprob, log_softmax(logits / T)[token] taken
    before top-k / top-p (SGLang's convention). Temperature <= 0 is greedy; each row draws from its
    own request's generator, so its tokens never depend on its batch companions. `parity`: the
    batch-invariant log-softmax of async_april/parity/."""
    logits = logits.float()
    temps = torch.tensor([sp.temperature for sp in sampling], device=logits.device)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = log_softmax(scaled) if parity else torch.log_softmax(scaled, -1)
    tokens = []
    for i, (sp, gen) in enumerate(zip(sampling, generators)):
        if greedy[i]:
            tokens.append(int(logp[i].argmax()))
            continue
        lp = top_k_top_p(logp[i], sp.top_k, sp.top_p) if (sp.top_k > 0 or sp.top_p < 1.0) else logp[i]
        tokens.append(int(torch.multinomial(lp.exp(), 1, generator=gen)))
    return tokens, logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def stage_weight_update(model: torch.nn.Module, buckets: Iterable[WeightBucket], version: int,
                        lora_base: dict[str, torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (parameter, new value) pair of an update, checked (names, shapes, dtypes, coverage) before
    anything is copied, so a failed update leaves the model as it was. Raises on the first problem.

    An update of LoRA adapter factors (names `<weight>.lora_A/B`, async_april/weights/lora.py) is staged
    by `stage_adapter_update` against `lora_base` (the engine's kept base weights)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers()))
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    adapters: list[tuple[str, torch.Tensor]] = []
    covered: set[int] = set()
    for bucket in buckets:  # a transport that fails mid-stream raises here, before any copy
        for name, tensor in bucket.items():
            if is_adapter_name(name):
                adapters.append((name, tensor))
                continue
            p = named.get(name)
            if p is None:
                raise KeyError(f"weight update: {name!r} is not a parameter of the engine's model")
            if p.shape != tensor.shape:
                raise ValueError(f"weight update: {name!r} has shape {tuple(tensor.shape)}, model has {tuple(p.shape)}")
            if p.is_floating_point() != tensor.is_floating_point():
                raise ValueError(f"weight update: {name!r} has dtype {tensor.dtype}, model has {p.dtype}")
            staged.append((p, tensor))
            covered.add(id(p))
    if adapters:
        if staged:
            raise ValueError(f"weight update to version {version} mixes LoRA adapter factors with {len(staged)} full "
                             f"tensors (e.g. {adapters[0][0]!r}); send one or the other")
        if lora_base is None:
            raise ValueError(f"weight update to version {version} is LoRA adapters, but this engine keeps no base weights")
        return stage_adapter_update(named, adapters, version, lora_base)
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(
            f"weight update to version {version} left {len(missing)} parameters unchanged "
            f"(e.g. {missing[:3]}); send every parameter of the model"
        )
    return staged


def stage_adapter_update(named: dict[str, torch.Tensor], adapters: list[tuple[str, torch.Tensor]], version: int,
                         base: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, base + scaled_B @ A) for every adapted weight, merged from the BASE the engine kept, never
    from its current (already merged) value, so no update accumulates rounding. The first adapter update
    keeps a host copy of each weight it names as the base; every later one must name the same weights
    (a weight left out would keep an old version's merge)."""
    pairs = pair_adapters(adapters)
    unknown = [w for w in pairs if w not in named]
    if unknown:
        raise KeyError(f"adapter update to version {version}: {unknown[:3]} are not parameters of the engine's model")
    if base and set(pairs) != set(base):
        raise ValueError(f"adapter update to version {version} names {len(pairs)} weights, the first named {len(base)} "
                         f"(e.g. {sorted(set(pairs) ^ set(base))[:3]}); send the adapters of every adapted weight")
    keep = {w: named[w].detach().to("cpu", copy=True) for w in pairs if w not in base}
    staged = [(named[w], merge_lora((base.get(w) if w in base else keep[w]).to(named[w].device), a, b))
              for w, (a, b) in pairs.items()]  # merge_lora checks the shapes, before any copy
    base.update(keep)
    return staged
