"""One run per run directory: an exclusive lock held for the run's whole life.

Two fresh runs started at once on one `run.dir` both pass the "is it used?" check
(neither has written a step yet), then interleave metrics.jsonl and overwrite each
other's checkpoints. So `train` takes `run.dir/run.lock` with `flock(LOCK_EX |
LOCK_NB)` before it writes anything there, keeps the file open until the run ends,
and the loser gets a RunDirError (exit 2) naming the holder.

Why flock: the kernel drops the lock when the holding process dies, however it
dies (SIGKILL, OOM, a power cut leaves no process at all), so a lock can never
outlive its run; the file left behind with a dead run's pid is a *stale* lock and
is simply taken over (and said so). flock is per open file description, so a
second attempt in the same process is refused too. On NFS, flock is emulated
with POSIX byte-range locks (Linux >= 2.6.12), which also die with their process.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from async_april.errors import RunDirError

LOCK_FILE = "run.lock"
"""In the run directory; holds the holder's pid, host and start time (for the loser's message)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    """`RunLock(run_dir).acquire()` ... `release()` (or `with RunLock(run_dir):`). `stale` tells, after
    acquiring, what a dead run left behind (its holder record), or None."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.stale: dict | None = None

    def acquire(self) -> "RunLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"run.dir {self.run_dir}: cannot create its lock file {LOCK_FILE} ({e.strerror}); "
                              "set run.dir to a directory you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(holder.get('started_unix', 0)))}"
                   if holder else "another process")
            raise RunDirError(f"run.dir {self.run_dir} is in use by another run ({who}); nothing was changed. "
                              "Wait for it to finish, or give this run another run.name (or run.dir)") from None
        previous = _read_holder(fd)
        if previous and not (previous.get("host") == socket.gethostname() and previous.get("pid") == os.getpid()):
            # The kernel released it: its process is gone (or, on another host, lost the lock with its node).
            self.stale = previous
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_unix": round(time.time(), 3)})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: the next run takes it over). Safe to call twice."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def stale_note(self) -> str | None:
        """A line for the console when a dead run's lock was taken over, else None."""
        s = self.stale
        if not s:
            return None
        state = "no longer running" if s.get("host") != socket.gethostname() or not _pid_alive(int(s.get("pid", 0))) \
            else "running but no longer holding it"
        return f"run.dir {self.run_dir}: took over a stale lock of pid {s.get('pid')} on {s.get('host')} ({state})"

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
