"""Blocking user code (environment steps, agent-loop tool calls) off the event loop, one thread per call."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from actors.engine import settle_future


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """Run fn(*args, **kwargs) in a daemon thread of its own; an asyncio future of its result. A thread
    per call (not a pool): a step that never returns must not take a pool worker from later steps."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target() -> None:
        try:
            value, exc = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle_future, fut, value, exc)
        except RuntimeError:  # the loop closed while a timed-out step was still running
            pass

    threading.Thread(target=target, name="env-step", daemon=True).start()
    return fut
