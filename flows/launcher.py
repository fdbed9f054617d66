"""Start a job's attempt in its keeper process, follow it, stop it; find it again after a restart.

The keeper (:mod:`flows.shim`) runs in a session of its own, so it and its
command outlive the node process: a node that restarts finds the keeper by its
pid and its start time (``/proc/<pid>/stat``, so a reused pid is never taken
for it), waits for it, and reads its outcome from the files it writes.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flows.outbox import JobFolder

log = logging.getLogger(__name__)

SHIM = Path(__file__).resolve().with_name("shim.py")
POLL_S = 0.5
"""How often a keeper that is not this process's child is checked, where pidfds are missing."""
OUTPUT_MAX_BYTES = 10 << 20
"""Output an attempt keeps in full (the keeper keeps the last lines beyond it)."""


@dataclass
class Keeper:
    """A keeper process: its pid, its start time in clock ticks, and whether it is our child."""

    pid: int
    start_ticks: int | None
    child: bool = False


def start_ticks(pid: int) -> int | None:
    """Return a process's start time in clock ticks since boot, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int | None, ticks: int | None) -> bool:
    """Return whether the process pid, started at ticks, still runs (not a zombie)."""
    if not pid:
        return False
    now = start_ticks(pid)
    if now is None or (ticks is not None and now != ticks):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
        state = data[data.rfind(b")") + 2:].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def launch(
    folder: JobFolder,
    number: int,
    *,
    argv: list[str],
    cwd: str | None,
    umask: int,
    timeout_s: float,
    env: Mapping[str, str],
    clock_offset_s: float = 0.0,
    max_bytes: int = OUTPUT_MAX_BYTES,
) -> Keeper:
    """Start attempt number's keeper with the job's environment; return it at once.

    Raises OSError when the keeper itself cannot start (the command's own
    failure to start is the keeper's to report, in its exit file).
    """
    spec_path = folder.attempt_path(number, "spec.json")
    spec = {
        "argv": argv, "cwd": cwd, "umask": umask, "timeout_s": timeout_s,
        "max_bytes": max_bytes, "clock_offset_s": clock_offset_s,
        "out": str(folder.attempt_path(number, "out")),
        "started": str(folder.attempt_path(number, "started")),
        "exit": str(folder.attempt_path(number, "exit")),
    }
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    errors = str(folder.attempt_path(number, "keeper.err"))
    # posix_spawn: no copy of the node's memory and no Popen to outlive (the keeper may
    # outlive this process); its own session, so a signal to the node's group misses it.
    pid = os.posix_spawn(
        sys.executable, [sys.executable, "-I", "-S", str(SHIM), str(spec_path)], dict(env),
        setsid=True,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, errors, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
        ],
    )
    return Keeper(pid=pid, start_ticks=start_ticks(pid), child=True)


def wait(keeper: Keeper, stop: threading.Event | None = None) -> bool:
    """Wait until the keeper has ended (and reap it when it is our child).

    Return False if stop was set first.
    """
    try:
        fd = os.pidfd_open(keeper.pid)
    except (OSError, AttributeError):
        fd = None
    try:
        while not _ended(keeper):
            if stop is not None and stop.is_set():
                return False
            if fd is not None:
                select.select([fd], [], [], 1.0)
            else:
                time.sleep(POLL_S)
    finally:
        if fd is not None:
            os.close(fd)
    return True


def _ended(keeper: Keeper) -> bool:
    if keeper.child:
        try:
            pid, _ = os.waitpid(keeper.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return True
        return pid == keeper.pid
    return not alive(keeper.pid, keeper.start_ticks)


def cancel(keeper: Keeper) -> bool:
    """Ask the keeper to stop its command (SIGTERM, then its own SIGKILL); False if it is gone."""
    if not alive(keeper.pid, keeper.start_ticks):
        return False
    try:
        os.kill(keeper.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True
