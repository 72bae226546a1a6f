"""SIGINT / SIGTERM during training: stop at a step boundary, save, say how to go on.

    with GracefulStop() as stop:        # installed after ray.init, which sets its own SIGTERM handler
        ... pool.wait_for_batch(stop=stop.requested) ...   a signal abandons the wait (no step half-done)
        ... if stop.requested(): save a checkpoint and leave the loop
    raise Interrupted(...)              # the CLI prints its one line and exits 128 + signal (130, 143)

Until the step loop `arm()`s it, a signal stops the start-up at once (there is
nothing to save yet; an SGLang server can take minutes to start). Once armed,
the first signal only sets a flag: the current learner step, if one is
running, finishes (an FSDP step cannot be cut in half), then the controller
saves a checkpoint, stops the actors and shuts Ray down. A second Ctrl-C aborts
at once (KeyboardInterrupt, no checkpoint); further SIGTERMs are ignored, since
`ray job stop` follows its SIGTERM with SIGKILL after RAY_JOB_STOP_WAIT_TIME_S
anyway.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from async_april.run.console import say

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped on a signal; `checkpoint` is where it can be resumed from (None: nothing to resume)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if checkpoint is None:
            msg = f"stopped by {name} before a step finished; nothing new to save, run the same command again"
        else:
            msg = (f"stopped by {name} after step {step}; checkpoint {checkpoint}; "
                   "continue with the same command plus run.resume=auto")
        super().__init__(msg)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """Context manager: while inside, SIGINT/SIGTERM set `requested()` instead of killing the process."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._previous: dict[int, object] = {}

    def requested(self) -> bool:
        return self.signum is not None

    def arm(self) -> None:
        """From now on a signal waits for the step boundary (called when the step loop starts)."""
        self.armed = True

    def _handle(self, signum: int, frame) -> None:
        if not self.armed:
            self.signum = signum
            raise Interrupted(signum, 0, None)
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: abort now, without a checkpoint
            return
        self.signum = signum
        say(f"{signal.Signals(signum).name}: stopping after the current step and saving a checkpoint "
            "(press Ctrl-C again to abort without saving)")

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
