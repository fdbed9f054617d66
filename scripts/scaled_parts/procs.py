"""Processes and ports of the scaled layout: start, record, stop and probe them; its errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO


class LayoutError(Exception):
    """Something the user must fix; the message says what and how."""


class MissingPrograms(LayoutError):
    """Programs the layout needs are not installed: Debian packages, or the project's own."""

    def __init__(self, debian: list[str], project: list[str]) -> None:
        self.debian, self.project = debian, project
        parts = []
        if debian:
            parts.append(
                f"missing Debian packages: {', '.join(debian)} (`make scaled-up` installs them"
                " where it may, as root; else `apt-get install postgresql postgresql-contrib"
                " redis-server haproxy`)")
        if project:
            parts.append(f"missing: {'; '.join(project)} (run `make setup`)")
        super().__init__("; ".join(parts))


STOP_GRACE_S = 20.0
"""Seconds ``stop`` waits after SIGTERM before SIGKILL."""
_T0 = time.monotonic()


def say(text: str) -> None:
    print(f"scaled: [{time.monotonic() - _T0:5.1f} s] {text}", flush=True)


def start_time(pid: int) -> int | None:
    """Return the start time of pid (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def alive(record: dict[str, int] | None) -> bool:
    """Return True if the recorded process still runs (same pid, same start time)."""
    return bool(record) and start_time(record["pid"]) == record["start"]  # type: ignore[index]


def record_of(pid: int) -> dict[str, int]:
    started = start_time(pid)
    if started is None:
        raise LayoutError(f"process {pid} exited as soon as it started")
    return {"pid": pid, "start": started}


SERVER_UMASK = 0o077
"""The umask of every process the layout starts: what a server writes (Redis's append-only
file and log, Prefect's home) is its owner's alone."""


def open_log(path: Path) -> BinaryIO:
    """Open path to append to, made 0600 if it is new (a log may hold what a server says)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


def spawn(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> dict[str, int]:
    """Start argv detached (own session, no stdin, output appended to log, umask 077); return
    its record."""
    with open_log(log) as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                umask=SERVER_UMASK)
    return record_of(proc.pid)


def stop(records: dict[str, dict[str, int] | None], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the recorded processes at once, wait up to grace_s, then SIGKILL what is left."""
    running = {name: rec for name, rec in records.items() if rec is not None and alive(rec)}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for rec in running.values():
            try:
                os.kill(rec["pid"], sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while running and time.monotonic() < deadline:
            for name, rec in list(running.items()):
                if not alive(rec):
                    say(f"stopped {name} (pid {rec['pid']})")
                    del running[name]
            time.sleep(0.1)
        if running and sig == signal.SIGTERM:
            say(f"still running {grace_s:.0f} s after SIGTERM: {', '.join(running)}: SIGKILL")
    if running:
        raise LayoutError(f"survived SIGKILL: {', '.join(running)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False
