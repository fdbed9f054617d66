"""Processes the tests start: one way to start, wait for and stop them (and a Prefect server).

Every process is started in a session of its own and stopped by its group:
SIGTERM, a grace period, then SIGKILL, so a test never leaves one behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path

import httpx

from ops import run_local

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """Return a TCP port nothing listens on (127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(what: str, done: Callable[[], bool], timeout: float, *,
             log: Path | None = None, every: float = 0.2) -> None:
    """Wait until done() holds; fail naming what, with the end of log, after timeout s."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-60:] if (
                log is not None and log.exists()) else []
            raise AssertionError(f"{what}: not within {timeout:g} s"
                                 + (f"; {log.name} ends:\n" + "\n".join(tail) if tail else ""))
        time.sleep(every)


def stop_group(proc: subprocess.Popen[bytes] | None, *, grace: float = 20.0) -> None:
    """Stop a process started in its own session: SIGTERM its group, wait up to grace s, then
    SIGKILL it (ops.run_local's stop); grace 0: SIGKILL at once, as a crash would."""
    if proc is None:
        return
    if grace > 0:
        run_local.stop_group(proc, grace, kill_wait_s=10.0)
    else:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def start(argv: list[str], *, env: Mapping[str, str], log: Path,
          cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """Start argv in a session of its own, its output appended to log."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)


class PrefectServer:
    """A real ``prefect server start`` on SQLite under a folder, stopped and started at will.

    Its environment is this process's with PREFECT_HOME=home, its API URL, and no UI and no
    analytics, unless env is given (its whole environment then).
    """

    def __init__(self, home: Path, *, port: int | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = home / "server.log"
        self.env = dict(env) if env is not None else {
            **os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def healthy(self) -> bool:
        """Return whether the server answers its health check now."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 120) -> None:
        """Start the server and wait until it is healthy."""
        self.proc = start([str(Path(sys.executable).parent / "prefect"), "server", "start",
                           "--host", "127.0.0.1", "--port", str(self.port)],
                          env=self.env, log=self.log, cwd=self.home)
        wait_for("the Prefect server healthy", self.healthy, timeout, log=self.log)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (its database stays for the next start); kill: SIGKILL at once."""
        stop_group(self.proc, grace=0.0 if kill else 20.0)
        self.proc = None


def read_until_closed(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Return everything the server sends on sock until it closes the connection (each read
    waits at most timeout)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)
