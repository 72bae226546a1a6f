"""Prompt datasets: rows of (prompt text, answer, extra fields), tokenized once.

Sources: `builtin:reverse` (the synthetic long-tail task) or a local .jsonl /
.parquet file with `data.prompt_key` / `data.answer_key` columns. Prompts are
tokenized on the driver; the rollout store receives numpy arrays. Epochs are
reshuffled by `run.seed + epoch`, so the stream is a pure function of the
global prompt index and a resumed run sees the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from async_april.config import Config, ConfigError


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
    truncated_long: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> PromptRow:
        """The prompt at global stream position `index` (epoch = index // len)."""
        epoch, pos = divmod(index, len(self.rows))
        if self.shuffle:
            pos = int(np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))[pos])
        return self.rows[pos]


def read_rows(cfg: Config) -> list[dict[str, Any]]:
    src = cfg.data.source
    if src == "builtin:reverse":
        from async_april.tasks.reverse import make_reverse_rows

        return make_reverse_rows(cfg.data.num_prompts, cfg.run.seed)
    path = Path(src).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.source {src!r} does not exist; give a .jsonl or .parquet file or builtin:reverse")
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON row ({e.msg})") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ConfigError(f"data.source {src!r}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")


def load_prompts(cfg: Config, tokenizer) -> PromptDataset:
    """Read, validate and tokenize every prompt row."""
    raw = read_rows(cfg)
    pk, ak = cfg.data.prompt_key, cfg.data.answer_key
    ds = PromptDataset(rows=[], seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    for i, r in enumerate(raw):
        if pk not in r:
            raise ValueError(f"{cfg.data.source}: row {i + 1} has no {pk!r} column (set data.prompt_key); keys: {sorted(r)}")
        prompt = str(r[pk])
        ids = np.asarray(encode_prompt(tokenizer, prompt), np.int64)
        if len(ids) > cfg.data.max_prompt_len:
            if cfg.data.on_long_prompt == "reject":
                ds.rejected_long += 1
                continue
            ids = ids[-cfg.data.max_prompt_len :]
            ds.truncated_long += 1
        extra = {k: v for k, v in r.items() if k not in (pk, ak)}
        ds.rows.append(PromptRow(prompt=prompt, answer=str(r.get(ak, "")), prompt_ids=ids, extra=extra))
    if not ds.rows:
        raise ValueError(f"{cfg.data.source}: no usable prompts ({ds.rejected_long} over data.max_prompt_len)")
    return ds


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Chat-templated when the tokenizer has a template, else plain with special tokens (BOS)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
