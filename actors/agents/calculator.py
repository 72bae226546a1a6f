"""A calculator tool for a real chat model: the worked example of docs/agents.md.

    rollout.env: actors.agents.calculator:CalculatorEnv
    rollout.agent.env_args: {max_calls: 4}
    data.source: a math dataset; reward: 1 when the final answer equals the row's answer

The model calls the tool in the Hermes / Qwen2.5 format, inside its turn:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
    </tool_call><|im_end|>

The environment parses the call from the turn's token ids (decoded once, for
parsing only: what is trained stays the sampled ids), evaluates the expression
with a small arithmetic evaluator (no `eval`), and answers with a `tool`
message rendered through the model's own chat template (`ChatTurns`): the
template's markers and the result, as token ids. A turn without a tool call is
the final answer: the last number in it (or in `\\boxed{}`) is compared with
the row's answer and the episode ends.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import numpy as np

from actors.agents.chat import ChatTurns
from async_april.environment import EnvRow, Environment, Reset, Step

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
"""Largest exponent the evaluator accepts: 10 ** 10 ** 10 would hang the tool thread."""


def evaluate(expression: str) -> float:
    """+ - * / ** and parentheses over numbers; ValueError for anything else."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return ev(ast.parse(expression, mode="eval"))


def final_number(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    found = NUMBER.findall(boxed[-1] if boxed else text)
    return found[-1] if found else None


class CalculatorEnv(Environment):
    def __init__(self, tokenizer=None, *, max_calls: int = 4, role: str = "tool") -> None:
        super().__init__(tokenizer)
        self.chat = ChatTurns(tokenizer)
        self.max_calls, self.role = max_calls, role

    def reset(self, row: EnvRow) -> Reset:
        # GSM8K-style answers carry their working before `#### 72`: keep the number.
        return Reset(state={"answer": row.answer.split("####")[-1].strip(), "calls": 0})

    def step(self, state: dict, turn_ids: np.ndarray) -> Step:
        text = self.tokenizer.decode(np.asarray(turn_ids).tolist(), skip_special_tokens=False)
        call = TOOL_CALL.search(text)
        if call is None:  # the final answer
            got = final_number(text)
            ok = got is not None and _same_number(got, state["answer"])
            return Step(np.zeros(0, np.int64), 1.0 if ok else 0.0, True, state)
        if state["calls"] >= self.max_calls:
            return Step(np.zeros(0, np.int64), 0.0, True, state)
        request = json.loads(call.group(1))
        value = evaluate(str(request["arguments"]["expression"]))
        result = json.dumps({"result": value})
        return Step(self.chat.observation(result, self.role), 0.0, False, dict(state, calls=state["calls"] + 1))

    def on_failure(self, state: dict, turn_ids: np.ndarray, error: str) -> Step:
        """A malformed call or expression (or a timeout): the model sees the error and may try again."""
        if state["calls"] >= self.max_calls:
            return Step(np.zeros(0, np.int64), 0.0, True, state)
        obs = self.chat.observation(json.dumps({"error": error}), self.role)
        return Step(obs, 0.0, False, dict(state, calls=state["calls"] + 1))


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()
