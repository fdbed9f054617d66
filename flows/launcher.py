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
import subprocess
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
    """A running keeper: its pid, its start time in clock ticks, and its Popen when ours."""

    pid: int
    start_ticks: int | None
    popen: subprocess.Popen[bytes] | None = None


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
    with open(folder.attempt_path(number, "keeper.err"), "ab") as errors:
        popen = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SHIM), str(spec_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
            env=dict(env), start_new_session=True, close_fds=True,
        )
    return Keeper(pid=popen.pid, start_ticks=start_ticks(popen.pid), popen=popen)


def wait(keeper: Keeper, stop: threading.Event | None = None) -> bool:
    """Wait until the keeper has ended; return False if stop was set first."""
    if keeper.popen is not None:
        while True:
            try:
                keeper.popen.wait(timeout=1.0)
                return True
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    return False
    try:
        fd = os.pidfd_open(keeper.pid)
    except (OSError, AttributeError):
        fd = None
    try:
        while alive(keeper.pid, keeper.start_ticks):
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


def cancel(keeper: Keeper) -> bool:
    """Ask the keeper to stop its command (SIGTERM, then its own SIGKILL); False if it is gone."""
    if not alive(keeper.pid, keeper.start_ticks):
        return False
    try:
        os.kill(keeper.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True
