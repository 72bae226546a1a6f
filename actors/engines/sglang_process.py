"""Ports and processes for SGLang servers launched by generation actors: a port per actor on a node
(an exclusive lock file plus a bind check), the launched server's process and log, and who listens
on its port."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import subprocess
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from actors.engines.sglang_wire import SGLangError


def claim_port(low: int, high: int) -> tuple[int, Any]:
    """A port in [low, high] no other actor on this node holds (an exclusive lock file kept open for
    the server's life) and nothing listens on; returns (port, the open lock file)."""
    lock_dir = Path(tempfile.gettempdir()) / "async_april_ports"
    lock_dir.mkdir(exist_ok=True)
    ports = list(range(low, high + 1))
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        f = open(lock_dir / f"{port}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                f.close()
                continue
        return port, f
    raise SGLangError(f"no free port in rollout.sglang.port_range [{low}, {high}]; widen it")


def launch_module_error(module: str) -> str | None:
    """Why `python -m module` cannot start here, or None. sglang 0.5.23 installs only on Python >= 3.11
    with glibc >= 2.34 (cp311-cp313 manylinux_2_34 wheels), so the `gpu` extra leaves it out elsewhere."""
    import importlib.util
    import platform
    import sys

    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except ModuleNotFoundError:  # its package is missing
        pass
    libc, ver = platform.libc_ver()
    here = f"Python {platform.python_version()}" + (f", {libc} {ver}" if libc else "")
    return (f"rollout.sglang.launch_module={module} is not importable by {sys.executable} ({here}): install the "
            "gpu extra (pip install -e '.[gpu]'); sglang 0.5.23 needs Python >= 3.11 and glibc >= 2.34")


def listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:`port`, when the OS lets us see it."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid is not None:
            return c.pid
    return None


def process_tree(pid: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


class LaunchedServer:
    """A server this actor launched on `port`: its process (a session of its own, so stopping it
    reaches what it spawned), the port's lock file held for its life, and its log in a temp file."""

    def __init__(self, cmd: list[str], port: int, port_lock: Any) -> None:
        self.port, self.port_lock = port, port_lock
        fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")
        try:
            self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            if port_lock is not None:  # no server will hold the port
                port_lock.close()
            raise
        finally:
            os.close(fd)

    def exit_code(self) -> int | None:
        """The process's exit code once it has exited, else None."""
        return self.proc.poll()

    def port_problem(self) -> str | None:
        """Why the server answering on our port is not this process (a neighbour bound it first), or None."""
        owner = listener_pid(self.port)
        if owner is not None and owner not in process_tree(self.proc.pid):
            return (f"port {self.port} is answered by process {owner}, not by the SGLang server this actor "
                    f"launched (pid {self.proc.pid}); another server holds the port")
        return None

    def log_tail(self, n: int = 30) -> str:
        if not os.path.exists(self.log_path):
            return "(no server log: its file is gone)"
        with open(self.log_path, errors="replace") as f:
            return "last server log lines:\n" + "".join(deque(f, n))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; the port's lock is released either way."""
        try:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        finally:
            if self.port_lock is not None:
                self.port_lock.close()
