"""Secrets kept out of everything the config is written to: config.yaml, W&B's config (and so its
offline files and what `wandb sync` uploads), `check`'s printout, metrics rows.

What counts as a secret:
  - the value of any environment variable whose name ends in _API_KEY, _TOKEN, _SECRET or
    _PASSWORD (WANDB_API_KEY, HF_TOKEN, ...; 8+ characters, so short flags are not masked);
  - the password of a URL with credentials (`http://user:PASSWORD@host`), and the value of a
    query parameter named like a secret (`?token=...`, `api_key=`, `password=`, `secret=`);
  - the argument after a command-line flag named like one (`--api-key X`, `--token=X`), as in
    `rollout.sglang.extra_args`;
  - the string value of a config entry whose key is named like one.
Each is replaced by `***`. The config in memory keeps the real values (an engine needs its URL).
"""

from __future__ import annotations

import os
import re
from typing import Any

MASK = "***"
SECRET_SUFFIXES = ("_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD")
"""Environment variables whose values are treated as secrets (WANDB_API_KEY, HF_TOKEN, ...)."""
_SECRET_WORD = r"(?:api[_-]?key|token|secret|password|passwd|pwd)"
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^@/\s]+)(?=@)")
_QUERY_SECRET = re.compile(rf"(?P<head>[?&;]{_SECRET_WORD}=)(?P<pw>[^&#\s]+)", re.IGNORECASE)
# A flag *ending* in the word (--api-key, --hf-token), so --max-total-tokens 4096 keeps its value.
_FLAG_INLINE = re.compile(rf"^(?P<head>--?[\w-]*{_SECRET_WORD}=)(?P<pw>.+)$", re.IGNORECASE)
_FLAG = re.compile(rf"^--?[\w-]*{_SECRET_WORD}$", re.IGNORECASE)
_KEY = re.compile(rf"{_SECRET_WORD}$", re.IGNORECASE)


def secret_values() -> list[str]:
    """Values of secret-looking environment variables (8+ characters, so short flags are not masked)."""
    return [v for k, v in os.environ.items() if k.upper().endswith(SECRET_SUFFIXES) and len(v) >= 8]


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret value from the environment, URL password and secret query value masked."""
    for v in secret_values() if secrets is None else secrets:
        text = text.replace(v, MASK)
    text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    return _QUERY_SECRET.sub(lambda m: m["head"] + MASK, text)


def mask_config(data: Any, secrets: list[str] | None = None) -> Any:
    """A copy of the plain-data config `data` (`Config.to_yaml_dict()`) with every secret masked."""
    secrets = secret_values() if secrets is None else secrets

    def walk(x: Any, key: str = "") -> Any:
        if isinstance(x, dict):
            return {k: walk(v, str(k)) for k, v in x.items()}
        if isinstance(x, list):
            out, hide_next = [], False
            for item in x:
                if hide_next and isinstance(item, str):
                    out.append(MASK)
                elif isinstance(item, str) and (m := _FLAG_INLINE.match(item)):
                    out.append(m["head"] + MASK)
                else:
                    out.append(walk(item, key))
                hide_next = isinstance(item, str) and bool(_FLAG.match(item))
            return out
        if isinstance(x, str):
            return MASK if _KEY.search(key) and x else redact(x, secrets)
        return x

    return walk(data)
