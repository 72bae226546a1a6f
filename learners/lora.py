"""LoRA on the FSDP2 learner (`learner.lora`): peft adapters on a frozen base, and what leaves the learner.

    apply_lora(model, lc)        peft's `inject_adapter_in_model`, BEFORE fully_shard: each target Linear X
                                 becomes X.base_layer (frozen) + X.lora_A.default / X.lora_B.default (trained),
                                 in place, so `model.layers` and the forward stay those of the HF model;
                                 each adapted Linear then runs `lean_forward` (peft's sum in three ops)
    frozen_base_dtype(...)       on GPU the frozen base is stored in model.dtype (bf16): nothing updates it,
                                 so its fp32 master copy would be memory spent for nothing
    LoraExport                   the learner's tensors under the ENGINE's names (async_april/weights/lora.py):
        merged   every base tensor, each adapted weight merged (W + scale * B @ A): full bytes, any engine
        adapter  only the factor pairs (A, scale * B): the torch engine merges them into the base it kept
    trainable_keys(model)        what a checkpoint holds: adapter parameters only (+ their optimizer state)
    base_model_hash(path)        sha256 of the base weights files, saved with every checkpoint and checked
                                 on load and export (adapters are meaningless on another base)
    merged_state / write_adapter_dir   `async-april export` (--merge or peft's adapter directory)

The loss, micro-batches, mini-batches and corrections are the learner's own: peft only changes which
parameters have gradients. Mixing frozen and trainable parameters in one FSDP2 unit is supported
(FSDP2 checks a uniform dtype over the trainable ones only).
"""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from async_april.errors import UserError
from async_april.weights.lora import adapter_names, merge_lora
from async_april.weights.buckets import TensorSpec

if TYPE_CHECKING:
    from async_april.config import Config, LoraConfig

ADAPTER = "default"
"""peft's adapter name: parameters are X.lora_A.default.weight and X.lora_B.default.weight."""
BASE_HASH_KEY = "base_sha256"
"""Key of the base-model hash in a LoRA learner checkpoint's extra state (and its learner.json)."""


class LoraTargetError(UserError, ValueError):
    """`learner.lora.target_modules` names no module of the model."""


def sync_mode(cfg: "Config") -> str:
    """What the engines get each version: `adapter` or `merged` (`learner.lora.sync`; auto = adapter for the
    torch engine, which merges itself, and merged for SGLang, whose weight routes take full tensors)."""
    mode = cfg.learner.lora.sync
    return mode if mode != "auto" else ("adapter" if cfg.rollout.engine == "torch" else "merged")


def peft_config(lc: "LoraConfig"):
    import peft

    return peft.LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules),
                           bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, lc: "LoraConfig") -> nn.Module:
    """Inject LoRA adapters into `model` in place (base frozen, adapters trainable; B = 0 so the model's
    outputs are unchanged). Raises LoraTargetError when no target module exists."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(peft_config(lc), model, adapter_name=ADAPTER)
    except ValueError as e:
        if "not found" not in str(e) and "Target modules" not in str(e):
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise LoraTargetError(f"learner.lora.target_modules={list(lc.target_modules)} matches no module of the model; "
                              f"its linear layers are named {linear}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)  # peft does this too; the invariant the optimizer relies on
    use_lean_forward(model)
    return model


def use_lean_forward(model: nn.Module) -> int:
    """Point every peft lora.Linear of `model` that holds just our adapter (no DoRA or other variant, weights
    stored out x in) at `lean_forward`; returns how many. Per instance: peft's class is untouched."""
    from peft.tuners.lora import Linear

    n = 0
    for m in model.modules():
        if (type(m) is Linear and list(m.lora_A) == [ADAPTER] and not m.lora_variant and not m.fan_in_fan_out
                and type(m.base_layer) is nn.Linear):
            m.forward = types.MethodType(lean_forward, m)
            n += 1
    return n


def lean_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's lora.Linear.forward (peft/tuners/lora/layer.py: `result = self.base_layer(x)`, then
    `result + lora_B(lora_A(dropout(x))) * scaling` per active adapter) for its plain case, in three ops:

        out = x W^T + b;   h = dropout(x) A^T;   y = addmm(out, h, B^T, alpha=scaling)

    Measured on the tiny model (hidden 128, rank 16, every linear layer; forward + backward of 512 packed
    tokens, CPU time, median of 37): full fine-tuning 85.0 ms, peft's forward 93.4 ms, this 84.0 ms. peft's
    way spends it on module calls (base_layer, lora_A, lora_B, dropout), its per-call checks, and a separate
    multiply and add over the [tokens, out] result (docs/benchmarks.md, "LoRA vs full fine-tuning").
    Anything else (disabled or merged adapters, extra arguments, an input in another dtype than the
    adapter) goes to peft's own forward."""
    a = self.lora_A[ADAPTER].weight
    if args or kwargs or self.disable_adapters or self.merged or x.dtype != a.dtype:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    out = F.linear(x, base.weight, base.bias)
    h = F.linear(self.lora_dropout[ADAPTER](x), a)
    y = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_B[ADAPTER].weight.t(),
                    alpha=self.scaling[ADAPTER])
    return y.view(out.shape)


def adapted_modules(model: nn.Module) -> list[str]:
    """Names of the modules that carry an adapter, in model order."""
    from peft.tuners.lora import LoraLayer

    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def freeze_base_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen parameters in `dtype` (GPU: bf16 halves their memory; the adapters stay fp32)."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def trainable_keys(model: nn.Module) -> frozenset[str]:
    return frozenset(n for n, p in model.named_parameters() if p.requires_grad)


def engine_name(key: str) -> str:
    """A learner state-dict key under the base model's name: X.base_layer.weight -> X.weight."""
    return key.replace(".base_layer.", ".")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class LoraExport:
    """The learner's weights as the engines see them (see the module docstring). Built before sharding;
    `specs` and `full_tensor` are called on the sharded model's state dict (names do not change)."""

    def __init__(self, model: nn.Module, lc: "LoraConfig", mode: str) -> None:
        if mode not in ("adapter", "merged"):
            raise ValueError(f"learner.lora.sync={mode!r}: expected adapter or merged")
        self.mode, self.scale = mode, lc.alpha / lc.rank
        self.targets = adapted_modules(model)  # X: X.base_layer.weight, X.lora_A/B.default.weight
        self._target_set = frozenset(self.targets)

    def specs(self, model: nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
        """Name, dtype and shape of every tensor sent, in send order. Adapter factors travel in fp32: the
        engine merges them in fp32 (merge_lora), as the learner's merged export does."""
        sd = model.state_dict()
        if self.mode == "adapter":
            out = []
            for x in self.targets:
                a_name, b_name = adapter_names(f"{x}.weight")
                out.append(TensorSpec(a_name, "float32", tuple(sd[f"{x}.lora_A.{ADAPTER}.weight"].shape)))
                out.append(TensorSpec(b_name, "float32", tuple(sd[f"{x}.lora_B.{ADAPTER}.weight"].shape)))
            return out
        every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        tied = every - {n for n, _ in model.named_parameters()}
        return [TensorSpec(engine_name(k), str(dtype if t.is_floating_point() else t.dtype).removeprefix("torch."), tuple(t.shape))
                for k, t in sd.items() if ".lora_" not in k and k not in tied]

    def full_tensor(self, sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The whole tensor sent as `name` (collective over ranks: each gathers the same shards)."""
        if self.mode == "adapter":
            x, part = name.rsplit(".weight.", 1)
            t = _full(sd[f"{x}.{part}.{ADAPTER}.weight"]).detach()
            return t.float() * self.scale if part == "lora_B" else t.float()
        x, _, leaf = name.rpartition(".")
        if x in self._target_set and leaf == "weight":
            a = _full(sd[f"{x}.lora_A.{ADAPTER}.weight"]).detach()
            b = _full(sd[f"{x}.lora_B.{ADAPTER}.weight"]).detach()
            return merge_lora(_full(sd[f"{x}.base_layer.weight"]).detach(), a, b.float() * self.scale)
        key = f"{x}.base_layer.{leaf}" if x in self._target_set else name
        return _full(sd[key]).detach()


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Base tensors (the base model's names) with every adapter (peft names, X.lora_A/B.default.weight) merged
    into its X.weight. What `export --merge` writes."""
    out = dict(base)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        x = key.split(".lora_A.")[0]
        if f"{x}.weight" not in out:
            raise UserError(f"adapter {key} has no base weight {x}.weight in the base model; is it the base it was trained on?")
        out[f"{x}.weight"] = merge_lora(out[f"{x}.weight"], a, adapters[f"{x}.lora_B.{ADAPTER}.weight"].float() * scale)
    return out


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full learner tensors with peft names (base and adapters) -> the base model's names, each adapted
    weight merged. What `checkpoint.export_hf` writes."""
    base = {engine_name(k): v for k, v in state.items() if ".lora_" not in k}
    return merge_adapters(base, {k: v for k, v in state.items() if ".lora_" in k}, scale)


def base_model_hash(model_path: str | Path) -> str:
    """sha256 over the base model's weight files (name and bytes, in name order). Reads every byte once:
    seconds per GB, paid when a LoRA checkpoint is saved, loaded or exported (then cached per process)."""
    path = Path(model_path)
    key = str(path.absolute())
    if key not in _HASHES:
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors or *.bin weight files to hash")
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


_HASHES: dict[str, str] = {}


def check_base(saved: str | None, model_path: str | Path, where: str) -> None:
    """A LoRA checkpoint's adapters belong to the base it was trained on: refuse any other."""
    if saved is None:
        raise UserError(f"{where} holds no {BASE_HASH_KEY}: it is not a LoRA learner checkpoint; "
                        "resume or export it with learner.lora.enabled=false")
    now = base_model_hash(model_path)
    if saved != now:
        raise UserError(f"{where} was trained on another base model (weights sha256 {saved[:12]}..., model.path "
                        f"{model_path} has {now[:12]}...); use the base model it was trained on")


def write_adapter_dir(state: dict[str, torch.Tensor], lc: "LoraConfig", base_path: str | Path, out: str | Path) -> Path:
    """peft's adapter directory (adapter_config.json + adapter_model.safetensors, as `PeftModel.save_pretrained`
    writes it: keys `base_model.model.<X>.lora_A.weight`), loadable with `PeftModel.from_pretrained(base, out)`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
               for k, v in state.items() if ".lora_" in k}
    if not weights:
        raise UserError(f"no adapter tensors in the checkpoint for {out}; was it trained with learner.lora.enabled=true?")
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    pc = peft_config(lc)
    pc.base_model_name_or_path = str(base_path)
    pc.save_pretrained(str(out))
    return out


def parameter_counts(model_path: str | Path, lc: "LoraConfig") -> dict[str, Any]:
    """Total and trainable parameters with `lc` (a meta-device model: no weights read), for `check`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    total = sum(p.numel() for p in model.parameters())
    if lc.enabled:
        model = apply_lora(model, lc)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total + (trainable if lc.enabled else 0), "trainable": trainable, "base": total}


def describe_counts(counts: dict[str, Any], gpu_bf16: bool) -> str:
    """One `check` line: trainable parameters and the learner memory for weights, gradients and AdamW
    (fp32 master + grad + 2 moments = 16 bytes per trainable parameter; the frozen base 4 bytes, 2 in bf16)."""
    base, trainable = counts["base"], counts["trainable"]
    full_gb = 16 * base / 1e9
    if trainable == base:
        return f"learner: {base / 1e6:.2f}M parameters, all trainable (weights + grads + AdamW {full_gb:.3g} GB)"
    frozen_gb = (2 if gpu_bf16 else 4) * base / 1e9
    lora_gb = frozen_gb + 16 * trainable / 1e9
    return (f"learner: LoRA, {trainable / 1e6:.3g}M trainable of {counts['total'] / 1e6:.2f}M parameters "
            f"({100 * trainable / counts['total']:.2g}%); weights + grads + AdamW {lora_gb:.3g} GB vs {full_gb:.3g} GB "
            "full fine-tuning (activations not counted)")


def json_meta(path: str | Path) -> dict[str, Any]:
    """learner.json of a learner checkpoint (world size, step, version, and for LoRA the base hash)."""
    return json.loads((Path(path) / "learner.json").read_text())
