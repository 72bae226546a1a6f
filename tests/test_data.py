"""Prompt datasets: JSONL / Parquet / Hugging Face sources, column mapping, chat templates,
long prompts, malformed rows, epochs; and a JSONL and a Parquet dataset each driving a short run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from async_april.config import ConfigError, config_from_dict
from async_april.data import DataError, PromptDataset, PromptRow, encode_prompt, get_path, load_prompts
from async_april.models.tiny import build_tokenizer
from async_april.tasks.reverse import make_reverse_rows

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Uses only characters in the tiny vocabulary, so rendered text maps 1:1 to ids.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }},"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def chat_tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def cfg_for(source, **data):
    return config_from_dict({"data": {"source": str(source), **data}, "run": {"seed": 3}})


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------- sources, columns


def test_jsonl_columns_reach_the_reward_as_extra(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "12=", "answer": "21", "id": 7, "level": "easy"},
        "",  # blank lines are ignored
        {"prompt": "345=", "answer": 543, "id": 8, "level": "hard"},
    ])  # fmt: skip
    ds = load_prompts(cfg_for(path), tok)
    assert [r.prompt for r in ds.rows] == ["12=", "345="]
    assert [r.answer for r in ds.rows] == ["21", "543"]  # non-string answers become text
    assert ds.rows[0].extra == {"id": 7, "level": "easy"}
    assert ds.rows[1].prompt_ids.tolist() == [tok.bos_token_id, *ids_of(tok, "345=")]


def test_dotted_keys_message_prompts_and_reserved_names(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": [{"role": "user", "content": "12="}], "reward_model": {"ground_truth": "21"}, "answer": "x"},
    ])  # fmt: skip
    ds = load_prompts(cfg_for(path, prompt_key="question", answer_key="reward_model.ground_truth"), tok)
    row = ds.rows[0]
    assert row.prompt == "12=" and row.answer == "21"
    assert row.extra["raw_answer"] == "x" and "answer" not in row.extra  # cannot collide with the reward's argument
    assert get_path({"a": {"b": 1}}, "a.b") == 1


def test_parquet_source(tmp_path, tok):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "12=", "a": "21", "src": "x"}, {"q": "9=", "a": "9", "src": "y"}]), path)
    ds = load_prompts(cfg_for(path, prompt_key="q", answer_key="a"), tok)
    assert [(r.prompt, r.answer, r.extra) for r in ds.rows] == [("12=", "21", {"src": "x"}), ("9=", "9", {"src": "y"})]


def test_hf_source_without_datasets_names_the_install(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match="pip install datasets"):
        load_prompts(cfg_for("hf:some/dataset"), tok)


def test_hf_source_local_files_and_save_to_disk(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "train.jsonl", [{"problem": "12=", "solution": "21"}, {"problem": "3=", "solution": "3"}])
    cfg = cfg_for(f"hf:{tmp_path / 'raw'}", prompt_key="problem", answer_key="solution", split="train")
    ds = load_prompts(cfg, tok)
    assert sorted((r.prompt, r.answer) for r in ds.rows) == [("12=", "21"), ("3=", "3")]
    datasets.Dataset.from_list([{"problem": "45=", "solution": "54"}]).save_to_disk(str(tmp_path / "saved"))
    ds = load_prompts(cfg_for(f"hf:{tmp_path / 'saved'}", prompt_key="problem", answer_key="solution"), tok)
    assert [(r.prompt, r.answer) for r in ds.rows] == [("45=", "54")]
    with pytest.raises(ConfigError, match="split='nope'"):
        load_prompts(cfg_for(f"hf:{tmp_path / 'raw'}", prompt_key="problem", split="nope"), tok)


def test_unknown_source_and_file_type(tmp_path, tok):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(cfg_for(tmp_path / "missing.jsonl"), tok)
    (tmp_path / "d.csv").write_text("prompt\n1=\n")
    with pytest.raises(ConfigError, match="unsupported file type '.csv'"):
        load_prompts(cfg_for(tmp_path / "d.csv"), tok)


# ------------------------------------------------------------------------- bad rows


BAD = [
    ('{"prompt": "12=", "answer": "21"}', None),
    ('{"prompt": "3=", "answer": ', "line 2: malformed JSON"),
    ('{"question": "4="}', "line 3: no 'prompt' column"),
    ('{"prompt": 123}', "line 4: column 'prompt' holds a int"),
    ('{"prompt": "   "}', "line 5: empty prompt"),
    ('["a", "list"]', "line 6: a row must be a JSON object"),
]


@pytest.mark.parametrize("n", range(1, len(BAD)))
def test_bad_row_error_names_file_line_and_problem(tmp_path, tok, n):
    path = write_jsonl(tmp_path / "d.jsonl", [BAD[0][0]] * n + [BAD[n][0]])  # the bad row is line n + 1
    with pytest.raises(DataError) as err:
        load_prompts(cfg_for(path), tok)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {BAD[n][1]}"), msg
    assert "data.on_bad_row=skip" in msg


def test_bad_rows_skipped_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [line for line, _ in BAD])
    ds = load_prompts(cfg_for(path, on_bad_row="skip"), tok)
    assert len(ds) == 1 and ds.bad_rows == len(BAD) - 1


# ------------------------------------------------------------------------- long prompts


def test_long_prompts_rejected_or_truncated_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12="}, {"prompt": "1234567="}])
    ds = load_prompts(cfg_for(path, max_prompt_len=5), tok)  # "12=" is 4 tokens with BOS, the other 9
    assert len(ds) == 1 and ds.rejected_long == 1 and ds.truncated_long == 0
    ds = load_prompts(cfg_for(path, max_prompt_len=5, on_long_prompt="truncate"), tok)
    assert ds.truncated_long == 1 and ds.rows[1].prompt_ids.tolist() == ids_of(tok, "4567=")  # keeps the last tokens
    with pytest.raises(DataError, match="no usable prompt at all .1 over data.max_prompt_len=3.*raise data.max_prompt_len"):
        load_prompts(cfg_for(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1234="}]), max_prompt_len=3), tok)


# ------------------------------------------------------------------------- chat templates


def test_chat_template_is_applied_with_system_prompt(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12", "answer": "21"}])
    ds = load_prompts(cfg_for(path), chat_tok)
    assert ds.rows[0].prompt_ids.tolist() == [chat_tok.bos_token_id, *ids_of(chat_tok, "12=")]
    ds = load_prompts(cfg_for(path, system_prompt="9"), chat_tok)
    assert chat_tok.decode(ds.rows[0].prompt_ids) == "<s>9,12="
    ds = load_prompts(cfg_for(path, chat_template="never"), chat_tok)  # raw text + BOS
    assert ds.rows[0].prompt_ids.tolist() == [chat_tok.bos_token_id, *ids_of(chat_tok, "12")]


def test_encode_prompt_handles_batch_encoding_and_message_lists(chat_tok, tok):
    out = chat_tok.apply_chat_template([{"role": "user", "content": "1"}], add_generation_prompt=True, tokenize=True)
    assert hasattr(out, "keys")  # transformers 5 returns a BatchEncoding, not a list of ids
    msgs = [{"role": "system", "content": "0"}, {"role": "user", "content": "12"}]
    assert chat_tok.decode(encode_prompt(chat_tok, msgs, system_prompt="9")) == "<s>0,12="  # the row's own system turn wins
    assert tok.decode(encode_prompt(tok, "12=", system_prompt="9")) == "<s>912="  # "9\n\n12=": newlines are not in the vocab


# ------------------------------------------------------------------------- epochs


def test_stream_is_infinite_and_reshuffled_per_epoch():
    rows = [PromptRow(str(i), "", np.array([1], np.int64)) for i in range(10)]
    ds = PromptDataset(rows, seed=5)
    epoch0 = [ds.row(i).prompt for i in range(10)]
    epoch1 = [ds.row(i).prompt for i in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r.prompt for r in rows)
    assert epoch0 != epoch1
    assert [ds.row(i).prompt for i in range(20)] == [PromptDataset(rows, seed=5).row(i).prompt for i in range(20)]
    assert [PromptDataset(rows, seed=5, shuffle=False).row(i).prompt for i in range(12)] == [str(i % 10) for i in range(12)]


# ------------------------------------------------------------------------- short runs


@pytest.fixture(scope="module")
def ray_cluster():
    from async_april.launch.controller import init_ray

    import ray

    started = init_ray(config_from_dict({}))
    yield
    if started:
        ray.shutdown()


def reverse_rows_file(tmp_path: Path, kind: str) -> Path:
    rows = [{"question": r["prompt"], "target": r["answer"], "row_id": i} for i, r in enumerate(make_reverse_rows(64, 11))]
    if kind == "jsonl":
        path = tmp_path / "reverse.jsonl"
        write_jsonl(path, [*rows, "{not json"])  # one malformed line, skipped and counted
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "reverse.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_and_parquet_files_give_the_same_prompts(tmp_path, tok):
    """The training run below reads the JSONL file; the Parquet file of the same rows loads to the same
    prompts, answers, extra columns and token ids (the malformed JSONL line is skipped and counted)."""
    pytest.importorskip("pyarrow")
    over = dict(prompt_key="question", answer_key="target", on_bad_row="skip")
    jsonl = load_prompts(cfg_for(reverse_rows_file(tmp_path, "jsonl"), **over), tok)
    parquet = load_prompts(cfg_for(reverse_rows_file(tmp_path, "parquet"), **over), tok)
    assert len(jsonl) == len(parquet) == 64 and jsonl.bad_rows == 1 and parquet.bad_rows == 0
    for a, b in zip(jsonl.rows, parquet.rows):
        assert (a.prompt, a.answer, a.extra) == (b.prompt, b.answer, b.extra)
    assert all(np.array_equal(jsonl.row(i).prompt_ids, parquet.row(i).prompt_ids) for i in range(64))


def test_dataset_file_drives_a_short_run(tmp_path, ray_cluster):
    from async_april.launch.controller import train

    kind = "jsonl"
    path = reverse_rows_file(tmp_path, kind)
    cfg = config_from_dict({
        "run": {"dir": str(tmp_path / "run"), "steps": 2, "seed": 1},
        "model": {"path": "builtin:tiny-reverse"},
        "data": {"source": str(path), "prompt_key": "question", "answer_key": "target", "on_bad_row": "skip"},
        "reward": {"functions": {"reverse_match": 1.0, "gsm8k": 0.5}},
        "rollout": {"batch_groups": 2, "n_samples": 4, "max_new_tokens": 32, "concurrency": 8},
        "learner": {"device": "cpu"},
    }, kind)  # fmt: skip
    seen = []
    run_dir = train(cfg, on_step=lambda step, batch, learner: seen.append((step, len(batch))))
    assert seen == [(1, 8), (2, 8)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/reverse_match"] <= 1.0 and 0.0 <= r["reward/gsm8k"] <= 1.0
        assert r["rollout/reward_mean"] == pytest.approx(r["reward/reverse_match"] + 0.5 * r["reward/gsm8k"], abs=1e-6)
