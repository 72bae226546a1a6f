"""Reward for the digit-reversal task: the fraction of positions that match."""

from __future__ import annotations

EOS_TEXTS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")
"""End-of-sequence spellings; a response decoded with special tokens is cut at the first one."""
SPECIAL_TEXTS = ("<pad>", "<s>", "<unk>", "<|pad|>")
"""Other special-token spellings removed from the response."""


def clean_response(response: str) -> str:
    """The response text without EOS and what follows it, special-token text or outer whitespace."""
    for eos in EOS_TEXTS:
        cut = response.find(eos)
        if cut >= 0:
            response = response[:cut]
    for special in SPECIAL_TEXTS:
        response = response.replace(special, "")
    return response.strip()


def reverse_match(prompt: str, response: str, answer: str, **extra) -> float:
    """Position-wise matches / max(len(answer), len(response)); 1.0 when both are empty.

    Too long and too short responses are penalised alike: every missing or
    extra character counts as a mismatch.
    """
    response = clean_response(response)
    answer = answer.strip()
    denom = max(len(answer), len(response))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, answer)) / denom
