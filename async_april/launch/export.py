"""`async-april export CHECKPOINT OUT_DIR [--merge]`: a Hugging Face model directory from any run checkpoint.

    CHECKPOINT   a run checkpoint (run.dir/checkpoints/step_XXXXXXXX), or a run directory (its newest
                 valid checkpoint); verified against its manifest first
    OUT_DIR      new (or empty) directory: config.json, model.safetensors, tokenizer files

The learner's shards are reassembled in this process (any saved world size, no torch.distributed,
no pickle: learners/checkpoint.py), the model's config and tokenizer come from the `model.path` in
the run's saved config.yaml, and the weights are written in `model.dtype` (or --dtype). The directory
is written under a temporary name and renamed into place, so OUT_DIR is never half written. Loading it
with `AutoModelForCausalLM.from_pretrained(OUT_DIR)` gives the learner's weights exactly (fp32).

A LoRA run (learner.lora.enabled) saved adapters only: OUT_DIR is then peft's adapter directory
(adapter_config.json + adapter_model.safetensors, `PeftModel.from_pretrained(base, OUT_DIR)`), or with
--merge the base model with the adapters merged in, a plain Hugging Face directory as above. Either way
the base at model.path must be the one trained on (its weights' sha256 is in the checkpoint).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from async_april.run.checkpoints import MANIFEST, Checkpoint, CheckpointError, CheckpointManager, check_model_fits, model_shape
from async_april.errors import UserError


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The verified run checkpoint `path` names (a checkpoint directory or a run directory), or a CheckpointError."""
    p = Path(path).expanduser().absolute()
    if (p / MANIFEST).is_file():
        return CheckpointManager(p.parent.parent).verify(p)
    if not p.is_dir():
        raise CheckpointError(f"CHECKPOINT {str(path)!r} does not exist; give run.dir/checkpoints/step_XXXXXXXX or a run directory")
    ck = CheckpointManager(p.parent if p.name == "checkpoints" else p).latest_valid()
    if ck is None:
        raise CheckpointError(f"CHECKPOINT {str(path)!r} is neither a run checkpoint (no {MANIFEST}) nor a run "
                              "directory with a valid checkpoints/step_*; give one of those")
    return ck


def run_config_of(ck: Checkpoint):
    """The resolved config the run saved next to its checkpoints (run.dir/config.yaml)."""
    from async_april.config import load_config

    saved = ck.path.parent.parent / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"{ck.path}: no config.yaml in its run directory {saved.parent}, so its model "
                              "(config, tokenizer) is unknown; export from a run directory async-april wrote")
    return load_config(saved)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None, merge: bool = False) -> Path:
    """Write OUT_DIR from CHECKPOINT (see the module docstring); returns OUT_DIR."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"OUT_DIR {str(out_dir)!r} already exists and is not an empty directory; give a new directory")
    if (blocker := next((p for p in out.parents if p.exists() and not p.is_dir()), None)) is not None:
        raise UserError(f"OUT_DIR {str(out_dir)!r} lies under {blocker}, which is a file, not a directory; "
                        "give a path under a directory")
    if not os.access(next(p for p in out.parents if p.exists()), os.W_OK):
        raise UserError(f"OUT_DIR {str(out_dir)!r} cannot be created: {next(p for p in out.parents if p.exists())} "
                        "is not writable; give a writable location")
    ck = open_checkpoint(checkpoint)
    cfg = run_config_of(ck)

    from transformers import AutoConfig  # torch and transformers only once the input is known good

    from async_april.models.paths import resolve_model_path
    from learners.checkpoint import full_model_state
    from learners.hf_dir import write_hf_dir

    try:
        model_path = Path(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
        check_model_fits(ck, model_shape(model_path))
    except (OSError, ValueError) as e:
        raise UserError(f"{ck.path}: its model.path {cfg.model.path!r} is not usable here ({e})") from None
    lc = cfg.learner.lora
    if merge and not lc.enabled:
        raise UserError(f"--merge: {ck.path} is of a full fine-tuning run (learner.lora.enabled=false); export it without --merge")
    state = full_model_state(ck.learner_dir)
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    if lc.enabled:
        from learners import lora

        lora.check_base(lora.json_meta(ck.learner_dir).get(lora.BASE_HASH_KEY), model_path, str(ck.path))
        if not merge:
            lora.write_adapter_dir(state, lc, model_path, tmp)
        else:
            state = lora.merge_adapters(lora_base_state(model_path), state, lc.alpha / lc.rank)
    if not lc.enabled or merge:
        write_hf_dir(state, AutoConfig.from_pretrained(model_path), model_path, tmp, dtype or cfg.model.dtype)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def lora_base_state(model_path: Path) -> dict:
    """The base model's tensors, as saved at model.path (what the adapters are merged into)."""
    from safetensors.torch import load_file

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise UserError(f"model.path {model_path}: no *.safetensors weights to merge the adapters into")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="async-april export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="CHECKPOINT", help="run.dir/checkpoints/step_XXXXXXXX, or a run directory")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory for the Hugging Face model")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="weight dtype (default: model.dtype of the run)")
    ap.add_argument("--merge", action="store_true", help="LoRA runs: write the base with the adapters merged in "
                    "(a plain Hugging Face directory) instead of peft's adapter directory")
    a = ap.parse_args(argv)
    from async_april.run.console import say

    out = export_checkpoint(a.checkpoint, a.out_dir, a.dtype, a.merge)
    say(f"exported {a.checkpoint} to {out}")
    print(out)
    return 0
