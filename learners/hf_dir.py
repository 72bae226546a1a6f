"""A Hugging Face model directory from full learner weights: what disk weight sync hands an SGLang
server (`/update_weights_from_disk`) and what `async-april export` writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_hf_dir(state_dict: dict[str, torch.Tensor], hf_config, model_path: str | Path, out: str | Path,
                 dtype: str = "float32") -> Path:
    """A Hugging Face model directory at `out`: `state_dict` (full tensors) cast to `dtype`, the model's
    config, and the tokenizer / generation config / chat template files copied from `model_path`."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in state_dict.items()}
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config)
    shell.load_state_dict(sd, assign=True, strict=False)
    shell.tie_weights()
    shell.save_pretrained(out)
    for f in Path(model_path).iterdir():  # tokenizer, generation config, chat template
        if f.is_file() and not f.name.startswith(("model", "config.json", "pytorch_model")) and f.suffix != ".safetensors":
            if not (out / f.name).exists():
                shutil.copy2(f, out / f.name)
    return out
