"""The built-in tiny model: a ~1M-parameter Qwen2 warm-started on digit reversal.

It is built locally (no model hub) and saved as an ordinary Hugging Face
directory, so engines and learners load it with `AutoModelForCausalLM` /
`AutoTokenizer.from_pretrained` exactly like a user's real model.

Build steps: a 19-token char-level tokenizer, a randomly initialised Qwen2
(hidden 128, 4 layers), then a short supervised warm start (teacher-forced
cross-entropy on the reversed digits + EOS) on prompts from a seed stream of
its own, tuned so that sampled reward is well below 1 and RL has room to
improve (sampled reward ~0.4, greedy ~0.6). The build is deterministic from the
seed, takes ~35 s on one CPU thread and happens once, into
`<cache_dir>/tiny-reverse-<hash>/`.

`builtin:tiny-reverse-turns` is the same model warm-started on the multi-turn
form of the task (async_april/tasks/reverse_turns.py): whole episodes, each
chunk followed by its reversal and EOS, so it knows the turn format before RL.

The warm start and its evaluation are async_april/models/warm_start.py; resolving `model.path`
to a directory is async_april/models/paths.py.

Launch: `python -m async_april.models.tiny [--cache-dir D] [--seed S] [--force] [--task reverse_turns]`
(or `async-april build-model`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from async_april.run.console import say
from async_april.models.warm_start import evaluate, evaluate_turns, sft_rows, warm_start
from async_april.tasks.reverse import LENGTH_BUCKETS, LENGTH_PROBS, sample_reverse_rows

BUILTIN_NAME = "builtin:tiny-reverse"
BUILTIN_TASKS = {BUILTIN_NAME: "reverse", "builtin:tiny-reverse-turns": "reverse_turns"}
"""Built-in model names and the task their warm start covers."""
DEFAULT_CACHE_DIR = "~/.cache/async_april"
MARKER = "BUILD_COMPLETE"
"""Written last inside a finished build directory."""
BUILD_VERSION = 1
"""Bump when the build code changes in a way the settings below do not capture."""

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
VOCAB: tuple[str, ...] = (PAD, BOS, EOS, UNK, *"0123456789", "=", " ", "+", "-", ",")
"""Token strings in id order: pad 0, bos 1, eos 2, unk 3, digits 4-13, then `=`, space, `+`, `-`, `,`."""

_EVAL_STREAM = 2
"""Seed stream of the build's evaluation rows (the warm start's is models/warm_start.py `SFT_STREAM`)."""


@dataclasses.dataclass(frozen=True)
class TinyBuildSettings:
    """Everything that determines the built model; hashed into its directory name."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    sft_steps: int = 100
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    sft_micro_batches: int = 4
    eval_prompts: int = 256
    eval_max_new_tokens: int = 48


# ---------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A char-level `PreTrainedTokenizerFast`; `tok("12=")` gives `<s> 1 2 =`.

    It is a byte-level BPE with single-character tokens and no merges: that is
    exactly what transformers' `Qwen2Tokenizer` (which `AutoTokenizer` forces
    for Qwen2 checkpoints) rebuilds from the saved files, so the built tokenizer
    and the loaded one agree. Characters outside `VOCAB` are dropped.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_level(t): i for i, t in enumerate(VOCAB)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )
    assert len(tok) == len(VOCAB), "special tokens must not add ids"
    return tok


def _byte_level(token: str) -> str:
    """Byte-level BPE spelling of a vocab entry: space is `Ġ`, other printable ASCII is itself."""
    return token if token.startswith("<") else token.replace(" ", "\u0120")


# ------------------------------------------------------------------- model


def _qwen2_config(tok, settings: TinyBuildSettings, overrides: dict):
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def _new_model(tok, settings: TinyBuildSettings, seed: int, overrides: dict):
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_qwen2_config(tok, settings, overrides))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return model.float()


def _save(model, tok, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)


@contextlib.contextmanager
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def build_random_tiny_model(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Write tokenizer + randomly initialised tiny Qwen2 (no warm start) to `out_dir`.

    For tests that need a real model quickly (~1 s). `overrides` go to
    `Qwen2Config` (e.g. `num_hidden_layers=2`).
    """
    out = Path(out_dir).expanduser()
    tok = build_tokenizer()
    with _one_thread():
        _save(_new_model(tok, TinyBuildSettings(), seed, overrides), tok, out)
    return out


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0,
                     settings: TinyBuildSettings = TinyBuildSettings(), task: str = "reverse") -> dict:
    """Build the warm-started tiny model into `out_dir`; returns the build info (also in build_info.json)."""
    out = Path(out_dir)
    t0 = time.perf_counter()
    tok = build_tokenizer()
    with _one_thread():
        model = _new_model(tok, settings, seed, {})
        final_loss = warm_start(model, tok, settings, seed, task)
        sft_s = time.perf_counter() - t0
        eval_rng = np.random.default_rng([seed, _EVAL_STREAM])
        if task == "reverse":
            eval_rows = sample_reverse_rows(eval_rng, settings.eval_prompts)
            sampled = evaluate(model, tok, eval_rows, sample=True, seed=seed,
                               max_new_tokens=settings.eval_max_new_tokens)
            greedy = evaluate(model, tok, eval_rows, sample=False, max_new_tokens=settings.eval_max_new_tokens)
        else:  # one episode at a time: a smaller held-out set keeps the build short
            eval_rows = sft_rows(eval_rng, settings.eval_prompts // 4, task)
            sampled = evaluate_turns(model, tok, eval_rows, sample=True, seed=seed)
            greedy = evaluate_turns(model, tok, eval_rows, sample=False)
        _save(model, tok, out)
    name = next(n for n, t in BUILTIN_TASKS.items() if t == task)
    info = {
        "name": name,
        "task": task,
        "seed": seed,
        "build_version": BUILD_VERSION,
        "settings": dataclasses.asdict(settings),
        "length_buckets": LENGTH_BUCKETS,
        "length_probs": LENGTH_PROBS,
        "num_params": sum(p.numel() for p in model.parameters()),
        "sft_final_loss": final_loss,
        "eval_sampled_reward": sampled,
        "eval_greedy_reward": greedy,
        "sft_seconds": round(sft_s, 1),
        "build_seconds": round(time.perf_counter() - t0, 1),
        "torch_version": torch.__version__,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# ------------------------------------------------------------------ cache


def build_hash(seed: int, settings: TinyBuildSettings, task: str = "reverse") -> str:
    """Short hash of the build settings, the task's length mix, the vocab and the seed."""
    key: dict = {} if task == "reverse" else {"task": task, "turns": _turn_task_shape()}  # reverse: hash as before tasks
    key |= {
        "v": BUILD_VERSION,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "buckets": LENGTH_BUCKETS,
        "probs": LENGTH_PROBS,
        "vocab": VOCAB,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _turn_task_shape() -> dict:
    from async_april.tasks.reverse_turns import CHUNK_LEN, CHUNKS

    return {"chunks": CHUNKS, "chunk_len": CHUNK_LEN}


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # no flock: racing builds still end in one complete directory
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_tiny_model(cache_dir: str = DEFAULT_CACHE_DIR, seed: int = 0, *, force: bool = False,
                      task: str = "reverse", **settings_overrides) -> Path:
    """Path of the built tiny model, building it first if missing (or if `force`).

    The build goes into a unique temporary directory that is renamed into
    place only once complete, so an interrupted build never leaves a half
    model. `settings_overrides` replace `TinyBuildSettings` fields (tests use
    `sft_steps=3`); they are part of the directory hash.
    """
    settings = dataclasses.replace(TinyBuildSettings(), **settings_overrides)
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    prefix = "tiny-reverse" if task == "reverse" else f"tiny-{task.replace('_', '-')}"
    target = root / f"{prefix}-{build_hash(seed, settings, task)}"
    if (target / MARKER).exists() and not force:
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if (target / MARKER).exists() and not force:
            return target  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        try:
            say(f"building the tiny model into {target} (seed {seed}, {settings.sft_steps} SFT steps; once, ~35 s)")
            build_tiny_model(tmp, seed, settings, task)
            (tmp / MARKER).write_text("ok\n")
            if target.exists():  # stale, incomplete or forced: move it aside first
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=root))
                os.replace(target, old / "model")
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not (target / MARKER).exists():  # lost a race to an incomplete directory
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# -------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the tiny model and print its path and warm-start figures."""
    parser = argparse.ArgumentParser(prog="async-april build-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                        help="cache directory (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="build seed (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    parser.add_argument("--task", choices=sorted(set(BUILTIN_TASKS.values())), default="reverse",
                        help="task the warm start covers (default %(default)s)")
    args = parser.parse_args(argv)
    path = ensure_tiny_model(args.cache_dir, args.seed, force=args.force, task=args.task)
    info = json.loads((path / "build_info.json").read_text())
    print(path)
    print(f"params {info['num_params']:,}  sampled reward {info['eval_sampled_reward']:.3f}  "
          f"greedy reward {info['eval_greedy_reward']:.3f}  build {info['build_seconds']}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
