"""The one kind of error a user can fix: bad input.

Every expected failure caused by what the user gave us -- config, YAML, data,
model, reward, checkpoint, run directory, plot input -- raises a subclass of
`UserError` whose message names the file, key or row and the fix. The CLI
prints it as one line, `error: <message>`, and exits 2, without a traceback
(async_april/launch/cli.py); `UserErrors` carries several, one line each. Anything
else is a bug or a fault and keeps its traceback.

This module imports nothing, so the config schema can use it.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, phrased for the person who gave it: what is wrong, where, and what to do."""


class UserErrors(UserError):
    """Several problems found together (`async-april check` lists every one it finds): the CLI prints one
    `error:` line per problem, after the `notes` (checks skipped because one they need failed)."""

    def __init__(self, problems: list[str], notes: list[str] | tuple[str, ...] = ()):
        super().__init__("; ".join(problems))
        self.problems, self.notes = list(problems), list(notes)


class ModelError(UserError, ValueError):
    """`model.path` does not name a usable model (missing directory, no config.json, no tokenizer)."""


class RunDirError(UserError, ValueError):
    """`run.dir` cannot be used: a file, not writable, already used by another run, or relative under `ray job submit`."""


class PlotError(UserError, ValueError):
    """`async-april plot` was given something that is not a run directory with metrics."""


MAX_LINE = 1000
"""Longest error line printed: a message quoting the input (an alias bomb, a huge value) is cut to this."""


class WeightsDivergedError(UserError, RuntimeError):
    """A learner step made the weights non-finite: the run stops before saving or broadcasting them."""


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """`text` on one line of at most `limit` characters: inner newlines become `; ` so a message stays
    one readable line in any log, and whatever it quotes cannot make it longer than that."""
    line = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(line) <= limit:
        return line
    keep = limit - 40
    return f"{line[:keep]} ... ({len(line) - keep} more characters)"


def short_repr(value: object, limit: int = 120) -> str:
    """`repr(value)` cut to `limit` characters (a value quoted in a message must not flood it).
    Bounded work too: containers are summarised by reprlib before repr walks them."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxtuple, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
