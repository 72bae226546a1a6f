"""Math rewards: `math_verify` (symbolic checking), `gsm8k` (final number), `format` (boxed answer).

All three take the reward signature `fn(prompt, response, answer, **extra) -> float`
and return 0.0 or 1.0; none raises on odd model output (unparseable text,
huge expressions, timeouts all score 0).

`math_verify` uses Hugging Face's `math-verify` package: the reference is parsed
(bare `42`, `\\frac{1}{2}`, or `$...$` / `\\boxed{}` LaTeX), the response's last
boxed answer or final expression is extracted, and the two compared with
numeric and symbolic (sympy) equivalence. math-verify bounds each parse and
comparison with `signal.alarm`, which only works in a process's main thread:
run it with `reward.num_workers > 0` (pool workers score in their main thread,
with timeouts). Called from any other thread it runs without the timeout.
"""

from __future__ import annotations

import re
import threading

from async_april.rewards.reverse import clean_response

TIMEOUT_S = 5
"""Seconds math-verify may spend on one parse or comparison (main thread only)."""
MAX_RESPONSE_CHARS = 20_000
"""Only the last this many characters of a response are parsed (answers come at the end)."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASH_ANSWER = re.compile(r"####\s*([^\n]*)")


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gold_text(answer: str) -> str:
    """Wrap a bare reference (`42`, `\\frac{1}{2}`) in `$...$` so the LaTeX extractor sees it."""
    a = answer.strip()
    if "$" in a or "\\boxed" in a or "\\(" in a or "\\[" in a:
        return a
    return f"${a}$"


def math_verify(prompt: str, response: str, answer: str, **extra) -> float:
    """1.0 if the response's final (preferably boxed) answer equals the reference mathematically."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:  # a clear message: the reward is configured but the package is missing
        raise ImportError("the math_verify reward needs the `math-verify` package: pip install math-verify") from e
    if not answer or not answer.strip():
        return 0.0
    t = _timeout()
    try:
        extract = [LatexExtractionConfig(), ExprExtractionConfig()]
        gold = parse(_gold_text(answer), extraction_config=extract, parsing_timeout=t)
        if not gold:
            return 0.0
        pred = parse(clean_response(response)[-MAX_RESPONSE_CHARS:], extraction_config=extract, parsing_timeout=t)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0
    except Exception:  # noqa: BLE001 - timeouts and sympy errors mean "not verified"
        return 0.0


def _to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def extract_final_number(text: str) -> float | None:
    """The number after the last `####` (GSM8K's answer marker), else the last number in the text."""
    text = clean_response(text)
    marked = _HASH_ANSWER.findall(text)
    if marked:
        nums = _NUMBER.findall(marked[-1])
        if nums:
            return _to_number(nums[0])
    nums = _NUMBER.findall(text)
    return _to_number(nums[-1]) if nums else None


def gsm8k(prompt: str, response: str, answer: str, **extra) -> float:
    """1.0 if the response's final number equals the reference's (`#### 42` or a bare number)."""
    want = extract_final_number(answer)
    got = extract_final_number(response)
    if want is None or got is None:
        return 0.0
    return 1.0 if abs(want - got) <= 1e-6 * max(1.0, abs(want)) else 0.0


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{\s*[^\s}]")
_ANSWER_TAGS = re.compile(r"<answer>\s*(?!</answer>)\S.*?</answer>", re.DOTALL)


def boxed_format(prompt: str, response: str, answer: str, **extra) -> float:
    """1.0 if the response contains a non-empty `\\boxed{...}` answer."""
    return 1.0 if _BOXED.search(response) else 0.0


def answer_tag_format(prompt: str, response: str, answer: str, **extra) -> float:
    """1.0 if the response contains a non-empty `<answer>...</answer>` block."""
    return 1.0 if _ANSWER_TAGS.search(response) else 0.0
