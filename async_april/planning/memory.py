"""The learner's memory plan: what one learner rank holds at its peak, against its GPU's memory.

Pure arithmetic from the model's config numbers (no torch here); `async-april check` prints it
(async_april/launch/memory_check.py) and refuses a recipe that cannot fit, naming the keys to change.

What a rank holds, as learners/worker.py and learners/parallelize.py build it:

  parameters   fp32 master weights (from_pretrained(dtype=float32)), FSDP2-sharded: 4 B x P / world_size
               (a LoRA base is frozen: bf16 on GPU (lora.freeze_base_dtype), fp32 on CPU)
  gradients    fp32, sharded like the parameters (FSDP2 reduce-scatters into the fp32 shard): 4 B x P / world
  optimizer    torch.optim.AdamW's exp_avg and exp_avg_sq, fp32 like the parameters: 8 B x P / world
               learner.offload_optimizer (FSDP2 CPUOffloadPolicy) moves all three to host memory
  gathered     what FSDP2 holds unsharded, in the compute dtype c (bf16 on GPU, fp32 on CPU): the root
               (embeddings, final norm, lm_head) and its gradient through forward and backward (2 root
               units), and 4 layer units at the peak, the backward of layer i: its weights, its gradients,
               layer i-1's weights (the default backward prefetch) and layer i+1's reduce-scatter input,
               held until the next reduce-scatter (torch 2.13 _fsdp_param_group.py reduce_scatter_states,
               reduce_scatter_max_input_buffers 1), in the reduce dtype, fp32 (_fsdp_collectives.py
               foreach_reduce): c x (2 root + 3 layers) + 4 x layer bytes. (The last layer, never
               resharded after forward, is the layer in use when backward starts.)
  activations  what autograd keeps for backward over one micro-batch of T tokens (T = the larger of
               learner.max_tokens_per_microbatch and the longest row, prompt + rollout.max_new_tokens:
               a longer row is trained alone); with activation checkpointing each layer keeps only its
               input and one layer is recomputed at a time
  logits       chunked (the learner's path, learners/chunked_logprobs.py): one chunk of CHUNK_POSITIONS
               positions at a time; full (the old path, for comparison): the [T, vocab] fp32 logits
               autograd keeps plus their gradient (8 B x T x vocab)
  head grad    the chunked head's backward accumulates the lm_head gradient [vocab, hidden] in place in
               fp32: with fp32 weights (CPU) that is the root's gradient itself (counted above); with bf16
               weights an fp32 accumulator (4 B x vocab x hidden) beside it, plus one [VOCAB_SLICE, hidden]
               bf16 product at a time (measured on CPU: tests/test_memory_plan.py)
  reserve      on GPU: the CUDA context and the caching allocator's fragmentation

Colocated with SGLang (learner.gpus_per_rank < 1), the engine takes `mem_fraction_static` of the
memory free when it starts for weights and KV cache (sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py
`_profile_available_bytes`: KV budget = free memory after the weights - pre_model_load_memory x
(1 - mem_fraction_static)) plus its own activations and CUDA graphs outside that share. The controller
starts the engines before the learner, so "free when it starts" is the whole GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

GB = 1e9
CHUNK_POSITIONS = 1024
"""Positions per chunk on the chunked logits path: learners/chunked_logprobs.py CHUNK_POSITIONS (a test
keeps the two equal); forward and backward each hold one [chunk, vocab] fp32 block and its gradient."""
VOCAB_SLICE = 8192
"""Vocabulary rows per bf16 product the head's backward adds into its fp32 accumulator: learners/chunked_logprobs.py
VOCAB_SLICE (a test keeps the two equal)."""
CUDA_CONTEXT_GB = 1.0
"""The CUDA context and NCCL buffers of a rank, outside the caching allocator."""
FRAGMENTATION = 0.10
"""Share of the allocator's peak lost to fragmentation (caching allocator blocks that cannot be reused)."""
SGLANG_RUNTIME_GB = 12.5
"""SGLang's memory outside its static share (activations, CUDA graph buffers): sglang 0.5.23's own estimate
when it picks mem_fraction_static itself (srt/arg_groups/memory_hook.py: 512 MB + 1.5 MB per token of its
default 8192-token chunked prefill, at least 10 GB on GPUs over 60 GB)."""
SGLANG_DEFAULT_RESERVE_GB = 10.0
"""With mem_fraction_static unset, sglang 0.5.23 sets it to (GPU memory - ~10 GB) / GPU memory on a GPU over
60 GB (memory_hook.py): it leaves nothing for a learner sharing the GPU."""

LogitsPath = Literal["full", "chunked"]


@dataclass(frozen=True)
class ModelDims:
    """The model's numbers the plan needs (config.json, plus the parameter count)."""

    params: int
    """All parameters (a LoRA model: the base plus the adapters)."""
    trainable: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    qk_norm: bool = False
    """Qwen3's per-head RMSNorm of q and k (two more saved tensors per layer)."""

    @classmethod
    def from_hf_config(cls, config: dict, params: int, trainable: int | None = None) -> ModelDims:
        c = config.get("text_config", config) if "hidden_size" not in config else config
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return cls(params=int(params), trainable=int(params if trainable is None else trainable), hidden=hidden,
                   layers=int(c["num_hidden_layers"]), heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or hidden // heads), intermediate=int(c["intermediate_size"]),
                   vocab=int(c["vocab_size"]), tied_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qk_norm=c.get("model_type") == "qwen3")

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and (untied) lm_head: the FSDP2 root unit."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def layer_params(self) -> float:
        return (self.params - self.root_params) / max(self.layers, 1)


@dataclass(frozen=True)
class PlanInputs:
    """The settings that decide a learner rank's memory (config keys in the comments)."""

    world_size: int = 1  # learner.world_size
    microbatch_tokens: int = 8192  # learner.max_tokens_per_microbatch
    longest_row: int = 0  # data.max_prompt_len + rollout.max_new_tokens
    activation_checkpointing: bool = False  # learner.activation_checkpointing
    offload_optimizer: bool = False  # learner.offload_optimizer
    logits_path: LogitsPath = "chunked"  # the learner computes logprobs in its head, in chunks
    on_gpu: bool = True  # bf16 compute and the CUDA reserve; else fp32 on CPU
    gpu_memory_gb: float | None = None  # learner.gpu_memory_gb, or torch.cuda's
    sglang_share: float | None = None  # rollout.sglang.mem_fraction_static when colocated, else None
    sglang_engines: int = 0  # SGLang engines on the learner's GPU (0: not colocated)


@dataclass(frozen=True)
class Plan:
    rows: tuple[tuple[str, float, str], ...]
    """(item, GB on the rank's device, how it is counted)."""
    host_gb: float
    """Offloaded state in host memory (per rank)."""
    budget_gb: float | None
    """Memory left to the learner on its GPU (None: unknown, nothing refused)."""

    @property
    def total_gb(self) -> float:
        return sum(gb for _, gb, _ in self.rows)

    @property
    def fits(self) -> bool:
        return self.budget_gb is None or self.total_gb <= self.budget_gb

    def table(self) -> list[str]:
        lines = [f"{'learner rank memory':<22}{'GB':>9}  how"]
        lines += [f"{name:<22}{gb:>9.3f}  {how}" for name, gb, how in self.rows]
        lines.append(f"{'total':<22}{self.total_gb:>9.3f}")
        if self.host_gb:
            lines.append(f"{'host (offloaded)':<22}{self.host_gb:>9.2f}  fp32 params + grads + AdamW on CPU")
        lines.append(f"{'available':<22}{self.budget_gb:>9.2f}" if self.budget_gb is not None
                     else f"{'available':<22}{'?':>9}  no GPU here and learner.gpu_memory_gb unset: not checked")
        return lines


def activation_bytes_per_token_layer(m: ModelDims, on_gpu: bool) -> float:
    """Bytes autograd saves per token in one decoder layer (transformers' Llama/Qwen layer, sdpa).

    RMSNorm (x2): its fp32 upcast of the input and the normalised output (4 + c bytes x hidden);
    q/k/v and gate/up inputs; RoPE's q, k and their rotate_half; sdpa's q, k, v and output; o_proj's
    input; the MLP's gate, up, silu(gate) and their product (4 x intermediate). c = compute bytes.
    """
    c = 2 if on_gpu else 4
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    norms = 2 * m.hidden * (4 + c)
    attn = c * (m.hidden + 5 * q + 4 * kv + (2 * (q + kv) if m.qk_norm else 0))
    mlp = c * (m.hidden + 4 * m.intermediate)
    return norms + attn + mlp


def plan(m: ModelDims, s: PlanInputs) -> Plan:
    """Per-rank peak memory of one learner step (see the module docstring)."""
    c = 2 if s.on_gpu else 4
    ws = s.world_size
    frozen = m.params - m.trainable
    state = {"parameters": 4 * m.trainable / ws, "gradients": 4 * m.trainable / ws, "optimizer": 8 * m.trainable / ws}
    host = 0.0
    if s.offload_optimizer:
        host = sum(state.values())
        state = dict.fromkeys(state, 0.0)
    frozen_bytes = (2 if s.on_gpu else 4) * frozen / ws
    tokens = max(s.microbatch_tokens, s.longest_row)
    per_layer = activation_bytes_per_token_layer(m, s.on_gpu) * tokens
    if s.activation_checkpointing:
        acts = c * m.hidden * tokens * m.layers + per_layer
        acts_how = f"{tokens} tokens: each layer's input + one layer recomputed"
    else:
        acts = per_layer * m.layers
        acts_how = f"{tokens} tokens x {m.layers} layers, no checkpointing"
    acts += m.hidden * tokens * (8 + c)  # the final norm and lm_head's input
    positions = tokens if s.logits_path == "full" else min(tokens, CHUNK_POSITIONS)
    logits = 8 * positions * m.vocab
    # FSDP2 all-gathers into its own buffer at any world size; the reduce-scatter input is fp32 (reduce dtype)
    gathered = c * (2 * m.root_params + 3 * m.layer_params) + 4 * m.layer_params
    head = head_grad_bytes(m.vocab, m.hidden, c) if s.logits_path == "chunked" else 0.0  # full: one bf16 matmul
    rows = [
        ("parameters", state["parameters"] + frozen_bytes,
         "offloaded" if s.offload_optimizer else f"fp32 master / {ws} ranks" + (", frozen base bf16" if frozen and s.on_gpu else "")),
        ("gradients", state["gradients"], "offloaded" if s.offload_optimizer else f"fp32 / {ws} ranks"),
        ("optimizer", state["optimizer"], "offloaded" if s.offload_optimizer else f"AdamW m + v fp32 / {ws} ranks"),
        ("gathered weights", gathered, f"unsharded {'bf16' if s.on_gpu else 'fp32'} root + its grad, 4 layer units "
                                       "(in use, its grads, prefetched; fp32 reduce-scatter input)"),
        ("activations", acts, acts_how),
        ("logits", logits, f"{s.logits_path}: {positions} positions x {m.vocab} vocab, fp32 + grad"),
        ("head grad", head, f"fp32 accumulator {m.vocab} x {m.hidden} + one {VOCAB_SLICE}-row bf16 product" if head
         else "none: " + ("fp32, accumulated in the root's own gradient (above)" if s.logits_path == "chunked"
                          else "the full path's one product is the root's gradient (above)")),
    ]
    rows = [(name, b / GB, how) for name, b, how in rows]
    if s.on_gpu:
        rows.append(("CUDA reserve", CUDA_CONTEXT_GB + FRAGMENTATION * sum(gb for _, gb, _ in rows),
                     f"context {CUDA_CONTEXT_GB:g} GB + {FRAGMENTATION:.0%} fragmentation"))
    return Plan(tuple(rows), host / GB, learner_budget_gb(s))


def head_grad_bytes(vocab: int, hidden: int, compute_bytes: int) -> float:
    """What the chunked head's backward holds beyond the lm_head's own gradient (learners/chunked_logprobs.py
    `_accumulate_weight_grad`): nothing in fp32; with narrower weights, the fp32 [vocab, hidden] accumulator
    and one [VOCAB_SLICE, hidden] product in the weights' dtype."""
    if compute_bytes >= 4:
        return 0.0
    return 4.0 * vocab * hidden + compute_bytes * min(vocab, VOCAB_SLICE) * hidden


def learner_budget_gb(s: PlanInputs) -> float | None:
    """The GPU memory left to one learner rank: all of it, or what colocated SGLang engines leave."""
    if s.gpu_memory_gb is None:
        return None
    if not s.sglang_engines:
        return s.gpu_memory_gb
    share = s.sglang_share
    if share is None:  # SGLang's own default (memory_hook.py) keeps ~10 GB for itself and nothing for us
        return 0.0
    return s.gpu_memory_gb * (1 - s.sglang_engines * share) - s.sglang_engines * SGLANG_RUNTIME_GB


def remedies(m: ModelDims, s: PlanInputs) -> list[tuple[str, float]]:
    """Single-key changes that lower the plan or raise the budget, each with the total (or budget) after it."""
    out: list[tuple[str, float]] = []
    if not s.offload_optimizer:
        out.append(("learner.offload_optimizer=true", plan(m, replace(s, offload_optimizer=True)).total_gb))
    out.append((f"learner.world_size={2 * s.world_size}", plan(m, replace(s, world_size=2 * s.world_size)).total_gb))
    if not s.activation_checkpointing:
        out.append(("learner.activation_checkpointing=true", plan(m, replace(s, activation_checkpointing=True)).total_gb))
    if s.microbatch_tokens > max(s.longest_row, 16):
        half = max(s.microbatch_tokens // 2, s.longest_row, 16)
        out.append((f"learner.max_tokens_per_microbatch={half}", plan(m, replace(s, microbatch_tokens=half)).total_gb))
    if s.sglang_engines:
        lower = 0.4 if s.sglang_share is None else round(max(s.sglang_share - 0.1, 0.05), 2)
        budget = learner_budget_gb(replace(s, sglang_share=lower))
        out.append((f"rollout.sglang.mem_fraction_static={lower:g} (leaves the learner {budget:.3g} GB)", -1.0))
    return out


def refusal(m: ModelDims, s: PlanInputs) -> str | None:
    """None when the plan fits; else the message `check` prints, naming the keys to change."""
    p = plan(m, s)
    if p.fits:
        return None
    where = (f"{s.gpu_memory_gb:g} GB GPU" + (f" after SGLang's share (rollout.sglang.mem_fraction_static="
                                               f"{s.sglang_share}, {s.sglang_engines} engine(s) on it)"
                                               if s.sglang_engines else ""))
    changes = "; ".join(key if gb < 0 else f"{key} (then {gb:.3g} GB)" for key, gb in remedies(m, s))
    unset = " (unset: SGLang's default takes the whole GPU)" if s.sglang_engines and s.sglang_share is None else ""
    return (f"the learner needs {p.total_gb:.3g} GB per rank but has {p.budget_gb:.3g} GB of the {where}{unset}; "
            f"change one or more of: {changes}; or set learner.gpu_memory_gb if this GPU is not the one it runs on")
