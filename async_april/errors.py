"""The one kind of error a user can fix: bad input.

Every expected failure caused by what the user gave us -- config, YAML, data,
model, reward, checkpoint, run directory, plot input -- raises a subclass of
`UserError` whose message names the file, key or row and the fix. The CLI
prints it as one line, `error: <message>`, and exits 2, without a traceback
(async_april/launch/cli.py). Anything else is a bug or a fault and keeps its traceback.

This module imports nothing, so the config schema can use it.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, phrased for the person who gave it: what is wrong, where, and what to do."""


class ModelError(UserError, ValueError):
    """`model.path` does not name a usable model (missing directory, no config.json, no tokenizer)."""


class RunDirError(UserError, ValueError):
    """`run.dir` cannot be used: a file, not writable, already used by another run, or relative under `ray job submit`."""


class PlotError(UserError, ValueError):
    """`async-april plot` was given something that is not a run directory with metrics."""


def one_line(text: str) -> str:
    """`text` on one line: inner newlines become `; ` so a message stays one readable line in any log."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
