"""Prompt datasets: rows of (prompt text, answer, extra fields), tokenized once.

Sources (`data.source`):
- `builtin:reverse`: the synthetic long-tail digit-reversal task;
- `builtin:reverse_turns`: its multi-turn form (chunks revealed by `rollout.env=builtin:reverse_turns`);
- a local `.jsonl` (one JSON object per line) or `.parquet` file;
- `hf:NAME` through Hugging Face `datasets.load_dataset(NAME, data.hf_config,
  split=data.split)` (NAME may be a hub name, a local data directory or a
  directory written by `Dataset.save_to_disk`; `pip install datasets`).

Columns: `data.prompt_key` holds the prompt (a string, or a list of chat
messages `{"role", "content"}`), `data.answer_key` the reference answer; both
may be dotted paths into nested columns (`reward_model.ground_truth`). Every
other column reaches the reward function as an extra keyword argument (a
column named `prompt`, `response` or `answer` that is not the mapped one is
renamed `raw_<name>` so it cannot collide with the reward's own arguments).

Prompts are chat-templated through the tokenizer when it has a template
(`data.chat_template: auto`), with `data.system_prompt` as a system turn, and
tokenized on the driver; the rollout store receives numpy arrays. Prompts over
`data.max_prompt_len` tokens are rejected or truncated (keeping the last
tokens), and malformed rows stop the load with `file:line: what is wrong` or
are skipped (`data.on_bad_row`); each case is counted on the dataset
(`rejected_long`, `truncated_long`, `bad_rows`).

The prompt stream is infinite: global index i is row `i % len` of epoch
`i // len`, and each epoch is reshuffled by `(run.seed, epoch)`, so the stream
is a pure function of the index and a resumed run sees the same order.
`run.steps` (not the dataset size) ends a run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from async_april.config import Config, ConfigError
from async_april.errors import UserError
from async_april.structured import NestingError, loads_json

log = logging.getLogger(__name__)

RESERVED_EXTRA = ("prompt", "response", "answer")
"""Reward-function argument names; extra columns with these names are renamed `raw_<name>`."""


class DataError(UserError, ValueError):
    """Unusable data: a malformed row (with `data.on_bad_row: error`), an unreadable file, or no usable
    prompt at all; names the file, line or row, and the setting or fix."""


@dataclass
class PromptRow:
    prompt: str
    answer: str
    prompt_ids: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptDataset:
    rows: list[PromptRow]
    seed: int
    shuffle: bool = True
    rejected_long: int = 0
    """Rows dropped because the prompt was over `data.max_prompt_len` (on_long_prompt=reject)."""
    truncated_long: int = 0
    """Rows kept with their prompt cut to the last `data.max_prompt_len` tokens (on_long_prompt=truncate)."""
    bad_rows: int = 0
    """Malformed rows skipped (on_bad_row=skip): bad JSON, missing or non-text prompt, empty prompt."""

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> PromptRow:
        """The prompt at global stream position `index` (epoch = index // len); the stream never ends."""
        epoch, pos = divmod(index, len(self.rows))
        if self.shuffle:
            pos = int(np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))[pos])
        return self.rows[pos]


class BadRow(Exception):
    """Raised while reading or mapping one row; turned into a DataError or a skip by `load_prompts`."""


# ------------------------------------------------------------------------------------ reading


def iter_raw_rows(cfg: Config) -> Iterator[tuple[int, dict[str, Any] | BadRow]]:
    """(1-based line or row number, row dict or the BadRow describing why it is unusable).
    A missing file or an unknown kind of source raises here, before the first row is asked for."""
    src = cfg.data.source
    if src == "builtin:reverse":
        from async_april.tasks.reverse import make_reverse_rows

        return enumerate(make_reverse_rows(cfg.data.num_prompts, cfg.run.seed), 1)
    if src == "builtin:reverse_turns":
        from async_april.tasks.reverse_turns import make_turn_rows

        return enumerate(make_turn_rows(cfg.data.num_prompts, cfg.run.seed), 1)
    if src.startswith("hf:"):
        return enumerate(_read_hf(cfg), 1)
    path = Path(src).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.source {src!r} does not exist; give a .jsonl or .parquet file, hf:NAME, builtin:reverse or builtin:reverse_turns")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return enumerate(_read_parquet(path, src), 1)
    raise ConfigError(f"data.source {src!r}: unsupported file type {path.suffix!r}; use .jsonl, .parquet or hf:NAME")


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | BadRow]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, BadRow(f"not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                row = loads_json(line)
            except json.JSONDecodeError as e:
                yield lineno, BadRow(f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            except NestingError as e:
                yield lineno, BadRow(f"malformed JSON ({e})")
                continue
            yield lineno, row if isinstance(row, dict) else BadRow(f"a row must be a JSON object, got {type(row).__name__}")


def _read_parquet(path: Path, src: str) -> list[dict[str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"data.source {src!r} is not a readable parquet file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); check or re-export the file") from None


def count_rows(cfg: Config) -> int | None:
    """Rows the source will yield, when that is cheap to know (for the progress bar's ETA)."""
    src = cfg.data.source
    if src in ("builtin:reverse", "builtin:reverse_turns"):
        return cfg.data.num_prompts
    path = Path(src).expanduser()
    try:
        if path.suffix == ".jsonl" and path.is_file():
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if path.suffix == ".parquet" and path.is_file():
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - only a progress estimate; reading reports the real problem
        return None
    return None


def _read_hf(cfg: Config):
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source {cfg.data.source!r} needs the Hugging Face `datasets` package: "
            "pip install datasets  (or pip install 'async-april[data]')"
        ) from None
    name = cfg.data.source[3:]
    local = Path(name).expanduser()
    if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(local))  # written by save_to_disk
        if isinstance(ds, datasets.DatasetDict):
            if cfg.data.split not in ds:
                raise ConfigError(f"data.split {cfg.data.split!r} not in {str(local)!r}; splits: {sorted(ds)}")
            ds = ds[cfg.data.split]
        return ds
    try:
        return datasets.load_dataset(str(local) if local.exists() else name, cfg.data.hf_config, split=cfg.data.split)
    except Exception as e:  # noqa: BLE001 - re-raised with the settings that produced it
        raise ConfigError(
            f"data.source {cfg.data.source!r} (hf_config={cfg.data.hf_config!r}, split={cfg.data.split!r}) "
            f"could not be loaded: {type(e).__name__}: {e}"
        ) from e


def read_rows(cfg: Config) -> list[dict[str, Any]]:
    """Every well-formed row as a dict (malformed ones raise or are dropped per `data.on_bad_row`)."""
    out = []
    for lineno, row in iter_raw_rows(cfg):
        if isinstance(row, BadRow):
            if cfg.data.on_bad_row == "error":
                raise _data_error(cfg, lineno, str(row))
            continue
        out.append(row)
    return out


# ------------------------------------------------------------------------------------ mapping


def get_path(row: Mapping[str, Any], key: str) -> Any:
    """`row[key]`, or for a dotted key the nested value (`reward_model.ground_truth`). KeyError if absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def map_row(row: Mapping[str, Any], prompt_key: str, answer_key: str) -> tuple[str | list[dict], str, dict[str, Any]]:
    """(prompt: text or chat messages, answer text, extra columns) or BadRow."""
    try:
        prompt = get_path(row, prompt_key)
    except KeyError:
        raise BadRow(f"no {prompt_key!r} column (set data.prompt_key); columns: {sorted(row)}") from None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"empty prompt in column {prompt_key!r}")
    elif _is_messages(prompt):
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise BadRow(
            f"column {prompt_key!r} holds a {type(prompt).__name__}, not a string or a list of "
            "{'role': ..., 'content': ...} chat messages"
        )
    try:
        answer = get_path(row, answer_key)
    except KeyError:
        answer = ""
    answer = "" if answer is None else str(answer)
    for column, text in [(prompt_key, prompt)] if isinstance(prompt, str) else [(prompt_key, m["content"]) for m in prompt]:
        _check_unicode(text, column)
    _check_unicode(answer, answer_key)
    extra = {}
    for k, v in row.items():
        if k in (prompt_key, answer_key):
            continue
        extra[f"raw_{k}" if k in RESERVED_EXTRA else k] = v
    return prompt, answer, extra


def _check_unicode(text: str, column: str) -> None:
    """BadRow for text that is not Unicode a tokenizer can encode: JSON's `"\\ud800"` escape decodes to a
    lone surrogate, which Python keeps in a str but no UTF-8 encoder (the tokenizers' Rust side) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(f"column {column!r} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
                     "which is not Unicode text; fix the escape sequence in the row") from None


def _is_messages(x: Any) -> bool:
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in x)
    )


def _data_error(cfg: Config, lineno: int, what: str) -> DataError:
    unit = "line" if cfg.data.source.endswith(".jsonl") else "row"
    return DataError(
        f"{cfg.data.source}: {unit} {lineno}: {what}. Fix the row, or set data.on_bad_row=skip to skip "
        "malformed rows (they are counted)"
    )


# ------------------------------------------------------------------------------------ loading


def load_prompts(cfg: Config, tokenizer, limit: int | None = None) -> PromptDataset:
    """Read, validate, template and tokenize every prompt row (only the first `limit` rows if given:
    `async-april check`)."""
    from async_april.run.console import stage

    d = cfg.data
    ds = PromptDataset(rows=[], seed=cfg.run.seed, shuffle=d.shuffle)
    use_template = d.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
    total = count_rows(cfg)
    total = min(total, limit) if total is not None and limit is not None else (total or limit)
    rows = iter_raw_rows(cfg)
    with stage(f"tokenising {d.source}", total=total, unit="row") as bar:
        for lineno, raw in rows:
            if limit is not None and lineno > limit:
                break
            bar.update(1)
            _add_row(ds, cfg, tokenizer, use_template, lineno, raw)
    if ds.bad_rows or ds.rejected_long or ds.truncated_long:
        log.warning("%s: %d prompts; skipped %d malformed rows, rejected %d and truncated %d over data.max_prompt_len=%d",
                    d.source, len(ds.rows), ds.bad_rows, ds.rejected_long, ds.truncated_long, d.max_prompt_len)
    if not ds.rows:
        where = f"in its first {limit} rows" if limit is not None else "at all"
        raise DataError(
            f"{d.source}: no usable prompt {where} ({ds.rejected_long} over data.max_prompt_len={d.max_prompt_len}, "
            f"{ds.bad_rows} malformed); raise data.max_prompt_len, set data.on_long_prompt=truncate, or fix the rows"
        )
    return ds


def _add_row(ds: PromptDataset, cfg: Config, tokenizer, use_template: bool, lineno: int, raw) -> None:
    """Map, template and tokenize one raw row into `ds` (or count it as bad / too long)."""
    d = cfg.data
    try:
        if isinstance(raw, BadRow):
            raise raw
        prompt, answer, extra = map_row(raw, d.prompt_key, d.answer_key)
    except BadRow as e:
        if d.on_bad_row == "error":
            raise _data_error(cfg, lineno, str(e)) from None
        ds.bad_rows += 1
        return
    ids = np.asarray(encode_prompt(tokenizer, prompt, d.system_prompt, use_template), np.int64)
    if len(ids) > d.max_prompt_len:
        if d.on_long_prompt == "reject":
            ds.rejected_long += 1
            return
        ids = ids[-d.max_prompt_len :]
        ds.truncated_long += 1
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    ds.rows.append(PromptRow(prompt=text, answer=answer, prompt_ids=ids, extra=extra))


def chat_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """The prompt as chat messages, with the system prompt first unless the row brings its own."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def encode_prompt(tokenizer, prompt: str | list[dict], system_prompt: str | None = None, use_template: bool | None = None) -> list[int]:
    """Token ids of one prompt.

    With a chat template (`use_template`, default: the tokenizer has one): the messages
    rendered with `add_generation_prompt=True` (the template brings BOS and the
    assistant header). Without: plain text with the tokenizer's special tokens (BOS);
    a system prompt and chat messages are joined with blank lines.
    """
    if use_template is None:
        use_template = bool(getattr(tokenizer, "chat_template", None))
    if use_template:
        out = tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
            out = out["input_ids"]
        if len(out) and isinstance(out[0], (list, tuple, np.ndarray)):
            out = out[0]
        return [int(t) for t in out]
    parts = [system_prompt] if system_prompt else []
    parts += [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    return list(tokenizer("\n\n".join(parts), add_special_tokens=True)["input_ids"])
