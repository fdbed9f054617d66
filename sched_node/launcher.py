"""Start a job's attempt in its keeper process, follow it, stop it; find it again after a restart.

The keeper (:mod:`sched_node.shim`) runs in a session of its own, so it and its
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sched_node.outbox import JobFolder

log = logging.getLogger(__name__)

SHIM = Path(__file__).resolve().with_name("shim.py")
POLL_S = 0.5
"""How often a keeper that is not this process's child is checked, where pidfds are missing."""
OUTPUT_MAX_BYTES = 10 << 20
"""Output an attempt keeps in full (the keeper keeps the last lines beyond it)."""
WARM_KEEPERS = 2
"""Keepers started ahead, each waiting for a job (about 10 MB each)."""
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


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


def _spawn(argv: list[str], env: Mapping[str, str], errors: str,
           stdin: int | None = None) -> Keeper:
    """Start a keeper in a session of its own (posix_spawn: no copy of the node's memory)."""
    actions: list[tuple[Any, ...]] = [
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, errors, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
    ]
    if stdin is None:
        actions.insert(0, (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
    else:
        actions.insert(0, (os.POSIX_SPAWN_DUP2, stdin, 0))
    pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", str(SHIM), *argv],
                         dict(env), setsid=True, file_actions=actions)
    return Keeper(pid=pid, start_ticks=start_ticks(pid), child=True)


@dataclass
class _Warm:
    keeper: Keeper
    handoff: int
    """The write end of its stdin: one line hands it its job."""


class WarmKeepers:
    """Keepers started ahead (``shim.py --wait``), so a job starts when it is handed over.

    A warm keeper has imported what it needs and waits on a pipe; it gets the job's
    spec and environment through it, so its own environment is a bare ``PATH`` (never
    the agent's). It ends on its own when the pipe closes unused (the node stopped).
    """

    def __init__(self, size: int = WARM_KEEPERS) -> None:
        self.size = size
        self._wanted = 0
        """Keepers wanted for the next instant's windows (:meth:`want`), beyond ``size``."""
        self._ready: list[_Warm] = []
        self._lock = threading.Lock()
        self._filling = False

    def want(self, count: int) -> None:
        """Have count keepers ready for the windows of the next instant (then back to size)."""
        with self._lock:
            if self.size == 0 or count <= max(self._wanted, self.size):
                return
            self._wanted = count
            self._fill_later()

    def _target(self) -> int:
        return max(self.size, self._wanted) if self.size else 0

    def take(self) -> _Warm | None:
        """Return a live warm keeper, if one is ready (and start filling up again)."""
        with self._lock:
            while self._ready:
                warm = self._ready.pop(0)
                if alive(warm.keeper.pid, warm.keeper.start_ticks):
                    self._wanted = max(self._wanted - 1, 0)
                    self._fill_later()
                    return warm
                os.close(warm.handoff)
            self._fill_later()
        return None

    def _fill_later(self) -> None:
        if not self._filling and self.size > 0:
            self._filling = True
            threading.Thread(target=self._fill, name="warm-keepers", daemon=True).start()

    def _fill(self) -> None:
        try:
            while True:
                with self._lock:
                    if len(self._ready) >= self._target():
                        return
                try:
                    made = waiting_keeper()
                except OSError as exc:
                    log.warning("could not start a warm keeper: %s", exc)
                    return
                with self._lock:
                    closed = self.size == 0
                    if not closed:
                        self._ready.append(made)
                if closed:  # closed meanwhile: let it go
                    os.close(made.handoff)
                    wait(made.keeper)
                    return
        finally:
            with self._lock:
                self._filling = False

    def close(self) -> None:
        """Let the warm keepers go (each ends when its pipe closes) and reap them."""
        with self._lock:
            self.size = 0
            ready, self._ready = self._ready, []
        for warm in ready:
            os.close(warm.handoff)
            wait(warm.keeper)


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
    warm: WarmKeepers | None = None,
    before: Callable[[Keeper], None] = lambda keeper: None,
) -> Keeper:
    """Start attempt number in a keeper with the job's environment; return it at once.

    A keeper waiting on its pipe (a warm one, else one started now the same way) gets the
    job through the pipe, and only after ``before(keeper)`` returned: the node journals
    which keeper runs the attempt before any command can start, so a node killed in
    between finds the keeper after its restart, or a keeper that never got the job (it
    ends when the node's end of its pipe closes). Raises OSError when no keeper can start
    (the command's own failure to start is the keeper's to report, in its exit file), or
    what ``before`` raised (the keeper then ends unused).
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
    line = (json.dumps({"spec": str(spec_path), "env": dict(env)}) + "\n").encode()
    errors = str(folder.attempt_path(number, "keeper.err"))
    ready = warm.take() if warm is not None else None
    for keeper in (ready, None):
        if keeper is None:
            keeper = waiting_keeper(errors)
        try:
            before(keeper.keeper)
            os.write(keeper.handoff, line)
            return keeper.keeper
        except BrokenPipeError:  # a warm one died between the check and the write
            if keeper is not ready:
                raise
        finally:
            os.close(keeper.handoff)
    raise AssertionError("unreachable")


def waiting_keeper(errors: str = os.devnull) -> _Warm:
    """Start a keeper that waits on a pipe for its job (``shim.py --wait``) with a bare
    environment; return it and the write end of its pipe."""
    read, write = os.pipe()
    try:
        os.set_inheritable(read, False)
        keeper = _spawn(["--wait"], {"PATH": os.environ.get("PATH", DEFAULT_PATH)}, errors,
                        stdin=read)
    except OSError:
        os.close(write)
        raise
    finally:
        os.close(read)
    return _Warm(keeper, write)


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
