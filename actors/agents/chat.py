"""Chat-template turn markers as token ids, so an environment can append observations to a chat model.

A chat model's turn ends at its end-of-turn token (Qwen's `<|im_end|>`), which
the engine samples and keeps. What follows in the template -- the rest of the
assistant turn's closing text, the next message's header, the observation, and
the header that opens the model's next turn -- is the observation the
environment appends:

    ... model tokens <|im_end|>  |  \\n<|im_start|>tool\\n{"result": 42}<|im_end|>\\n<|im_start|>assistant\\n
        sampled (loss mask 1)    |  ChatTurns.observation(...) (loss mask 0)

`ChatTurns` renders a two-message conversation with and without one more
message through the tokenizer's own template, takes the difference as text and
tokenises only that piece: the conversation so far is never re-tokenised, so
the model's sampled tokens stay exactly as sampled. A template that rewrites
earlier turns when a message is added (Qwen3 drops `<think>` blocks from
history) has no such difference; the constructor says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_PROBE = [{"role": "user", "content": "PROBE_USER"}, {"role": "assistant", "content": "PROBE_REPLY"}]


class ChatTurns:
    """Observation token ids for one chat template.

    tokenizer: a Hugging Face tokenizer with a chat template.
    turn_end_id: the token that ends the model's turn (default: the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, turn_end_id: int | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatTurns needs a tokenizer with a chat template (tokenizer.chat_template is empty)")
        self.tokenizer = tokenizer
        self.turn_end_id = int(tokenizer.eos_token_id if turn_end_id is None else turn_end_id)
        self.turn_end_text = tokenizer.decode([self.turn_end_id])
        base = self._render(_PROBE, generation_prompt=False)
        reply_at = base.rfind("PROBE_REPLY")
        end_at = base.find(self.turn_end_text, reply_at)
        if reply_at < 0 or end_at < 0:
            raise ValueError(f"the chat template does not close an assistant turn with {self.turn_end_text!r} "
                             "(token id turn_end_id); pass the id of the token that ends the model's turn")
        self._base = base
        self._after_turn_end = base[end_at + len(self.turn_end_text):]
        """Template text between the model's end-of-turn token and the next message (e.g. a newline)."""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def observation_text(self, content: str, role: str = "user") -> str:
        """The text appended after the model's end-of-turn token: closing text, `role`'s message, and the
        header of the model's next turn."""
        full = self._render([*_PROBE, {"role": role, "content": content}], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(f"the chat template rewrites earlier turns when a {role!r} message is added, so an "
                             "observation cannot be appended as tokens; write the markers by hand for this model")
        return self._after_turn_end + full[len(self._base):]

    def observation(self, content: str, role: str = "user") -> np.ndarray:
        """Token ids of `observation_text` (only that text is tokenised)."""
        ids = self.tokenizer(self.observation_text(content, role), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, np.int64)
