"""The locally built tiny model: tokenizer, random model, SFT build and cache."""

import json

import pytest
import torch
from safetensors.torch import load_file

from async_april.models.tiny import (
    DEFAULT_CACHE_DIR,
    MARKER,
    build_random_tiny_model,
    build_tokenizer,
    ensure_tiny_model,
)
from async_april.models.paths import resolve_model_path

torch.set_num_threads(1)


def test_tokenizer_round_trip():
    tok = build_tokenizer()
    ids = tok("123=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "1", "2", "3", "="]
    assert tok("123=", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "123="
    assert tok.decode(tok("1 2,+-")["input_ids"], skip_special_tokens=True) == "1 2,+-"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert 17 <= len(tok) <= 20


def test_random_tiny_model_loads_like_a_real_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_random_tiny_model(tmp_path / "m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert model.config.vocab_size == len(tok)
    built = build_tokenizer()
    for text in ["123=", "90210=", "1 2,+-="]:  # AutoTokenizer picks Qwen2Tokenizer: ids must agree
        assert tok(text)["input_ids"] == built(text)["input_ids"]
    out = model(**tok(["12=", "3456="], return_tensors="pt", padding=True))
    assert out.logits.shape[-1] == len(tok)

    smaller = build_random_tiny_model(tmp_path / "s", seed=0, num_hidden_layers=1)
    assert AutoModelForCausalLM.from_pretrained(smaller).config.num_hidden_layers == 1


def test_resolve_model_path(tmp_path):
    path = build_random_tiny_model(tmp_path / "m")
    assert resolve_model_path(str(path), str(tmp_path)) == path
    with pytest.raises(FileNotFoundError, match="model.path '.*nope' does not exist.*builtin:tiny-reverse"):
        resolve_model_path(str(tmp_path / "nope"), str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"), str(tmp_path))
    with pytest.raises(ValueError, match="not a built-in model"):
        resolve_model_path("builtin:nope", str(tmp_path))


def _weights(path):
    return load_file(path / "model.safetensors")


def test_short_build_is_deterministic_and_cached(tmp_path, capsys):
    quick = dict(sft_steps=3, eval_prompts=8, eval_max_new_tokens=8)
    a = ensure_tiny_model(str(tmp_path / "a"), seed=0, **quick)
    b = ensure_tiny_model(str(tmp_path / "b"), seed=0, **quick)
    assert a.name == b.name and a.name.startswith("tiny-reverse-")
    assert (a / MARKER).exists() and "SFT warm start: done (3 steps)" in capsys.readouterr().err
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    info = json.loads((a / "build_info.json").read_text())
    assert 0 <= info["eval_sampled_reward"] <= 1 and 0 <= info["eval_greedy_reward"] <= 1

    assert ensure_tiny_model(str(tmp_path / "a"), seed=0, **quick) == a  # cached: no rebuild
    assert "sft step" not in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "a").iterdir() if not p.name.endswith(".lock")] == [a.name]
    assert ensure_tiny_model(str(tmp_path / "a"), seed=1, **quick) != a  # the seed is in the hash


def test_full_build_leaves_room_for_rl(tmp_path):
    """The default build (the one every run and most tests use, in the default cache: built there by
    whichever test needed it first, or now) is warm enough to learn from and far from solved.
    Determinism is checked on a short build above: the same code path, without ~50 s per build."""
    from transformers import AutoModelForCausalLM

    path = ensure_tiny_model(DEFAULT_CACHE_DIR, seed=0)
    info = json.loads((path / "build_info.json").read_text())
    assert 0.25 <= info["eval_sampled_reward"] <= 0.7
    assert info["eval_greedy_reward"] >= info["eval_sampled_reward"] - 0.05
    assert resolve_model_path("builtin:tiny-reverse", DEFAULT_CACHE_DIR) == path
    AutoModelForCausalLM.from_pretrained(path)


def test_multi_turn_warm_start_covers_the_turn_format(tmp_path):
    """builtin:tiny-reverse-turns: its own cache entry, trained on whole episodes with labels on the
    model's replies (and their EOS) only, never on the environment's chunks."""
    from async_april.models.warm_start import sft_sequence as _sft_sequence

    tok = build_tokenizer()
    ids, labels = _sft_sequence(tok, {"prompt": "314=", "answer": "314,15", "chunks": ["314", "15"]})
    assert tok.decode(ids) == "<s>314=413</s>15=51</s>"
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    assert tok.decode(trained) == "413</s>51</s>" and labels == [lab if lab == -100 else t for t, lab in zip(ids, labels)]
    quick = dict(sft_steps=3, eval_prompts=8, eval_max_new_tokens=8)
    turns = ensure_tiny_model(str(tmp_path), seed=0, task="reverse_turns", **quick)
    single = ensure_tiny_model(str(tmp_path), seed=0, **quick)
    assert turns.name.startswith("tiny-reverse-turns-") and single.name.startswith("tiny-reverse-") and turns != single
    info = json.loads((turns / "build_info.json").read_text())
    assert info["task"] == "reverse_turns" and info["name"] == "builtin:tiny-reverse-turns"
    assert 0 <= info["eval_sampled_reward"] <= 1
