"""The job's keeper: one small process per attempt, between the node and the command.

Run as ``python -I -S sched_node/shim.py SPEC`` (standard library only, ~10 MB), in a
session of its own: it outlives the node process, so a node killed mid-job neither
kills the job nor loses its outcome. The node keeps one or two started ahead
(``--wait``, :mod:`sched_node.launcher`), so a window's command starts as soon as the
node hands it over, not after a Python start-up.

1. Read SPEC (JSON: ``argv``, ``cwd``, ``umask``, ``timeout_s``, ``out``,
   ``started``, ``exit``, ``max_bytes``, ``clock_offset_s``). Its own environment
   is the job's. Every time it writes is the wall clock plus ``clock_offset_s``
   (the node's clock, which is the wall clock unless a test shifts it).
2. Start ``argv`` without a shell, in a process group of its own, stdin from
   /dev/null, stdout and stderr to a pipe each. If it cannot start, write the exit
   file with the error and end.
3. Write the ``started`` file: the command's pid and the instant it started.
4. Copy every output line of both streams to ``out`` as a JSON line ``{"t": <UTC
   time>, "m": <text>}`` (``"s": "err"`` for stderr's) as it comes (flushed per
   line, so the node can follow it). Past ``max_bytes`` only the last
   :data:`TAIL_LINES` lines are kept, and the number of lines dropped is said at
   the end.
5. On ``timeout_s`` kill the command's group (SIGKILL). On SIGTERM or SIGINT
   (the node cancelling the job) send SIGTERM to the group, then SIGKILL after
   :data:`KILL_AFTER_S`.
6. When the command has exited and its output is closed, write the ``exit``
   file (atomically): exit code (negative: the signal that killed it), whether
   it timed out or was cancelled, when it ended, the lines seen and dropped, and
   the last :data:`CAUSE_LINES` non-empty lines of each stream (``err_tail``,
   ``out_tail``: a failure's cause).

Files 3 and 6 are written once each, to a temporary name and renamed, so a
reader sees all of one or none of it.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

TYPE_CHECKING = False  # typing is not imported at run time: it would slow the keeper's start
if TYPE_CHECKING:
    from typing import IO, Any

TAIL_LINES = 100
KILL_AFTER_S = 10.0
CAUSE_LINES = 5
"""The last lines of each stream the exit file keeps (the failure's cause, in the report)."""
CAUSE_LINE_MAX = 300


_OFFSET = timedelta(0)
"""The node's clock minus the wall clock when it started this keeper (~0: both read the wall
clock; a test's node runs a shifted clock): the keeper's times are in the node's clock."""


def _now() -> str:
    return (datetime.now(UTC) + _OFFSET).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def _write_once(path: str, data: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _kill_group(pid: int, sig: int) -> None:
    # Written out again here, not imported: the keeper runs with -I -S on the standard library.
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _handoff(argv: list[str]) -> tuple[str, dict[str, str]] | None:
    """Return the SPEC path and the command's environment; None when a warm keeper gets EOF."""
    if argv[1:] == ["--wait"]:
        line = sys.stdin.readline()
        if not line:
            return None
        handoff = json.loads(line)
        return str(handoff["spec"]), dict(handoff["env"])
    return argv[1], dict(os.environ)


def _start(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """Start the command (step 2); when it cannot start, write the exit file saying why."""
    try:
        return subprocess.Popen(
            spec["argv"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=spec.get("cwd") or None,
            umask=int(spec.get("umask", 0o077)),
            process_group=0,
            close_fds=True,
            env=env,
        )
    except OSError as exc:
        _write_once(spec["exit"], {"exit_code": None, "timed_out": False, "cancelled": False,
                                   "at": _now(), "lines": 0, "dropped": 0,
                                   "error": f"cannot start {spec['argv'][0]!r}: {exc}"})
        return None


def _arm_stops(pid: int, timeout_s: float) -> tuple[dict[str, bool], threading.Timer]:
    """Arm step 5: the timeout's kill and the cancel signals; return the flags they set and
    the timeout's timer."""
    flags = {"timed_out": False, "cancelled": False}

    def on_timeout() -> None:
        flags["timed_out"] = True
        _kill_group(pid, signal.SIGKILL)

    def on_cancel(signum: int, frame: object) -> None:
        if flags["cancelled"]:
            return
        flags["cancelled"] = True
        _kill_group(pid, signal.SIGTERM)
        later = threading.Timer(KILL_AFTER_S, _kill_group, (pid, signal.SIGKILL))
        later.daemon = True
        later.start()

    signal.signal(signal.SIGTERM, on_cancel)
    signal.signal(signal.SIGINT, on_cancel)
    timer = threading.Timer(timeout_s, on_timeout)
    timer.daemon = True
    timer.start()
    return flags, timer


class _Output:
    """The command's output as one file of lines (step 4), from its two streams at once."""

    def __init__(self, out: IO[str], max_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_bytes
        self.written = self.lines = self.dropped = 0
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.last: dict[str, collections.deque[str]] = {
            "out": collections.deque(maxlen=CAUSE_LINES),
            "err": collections.deque(maxlen=CAUSE_LINES)}
        self.lock = threading.Lock()

    def copy(self, stream: IO[bytes], name: str) -> None:
        """Copy one stream's lines (stderr's marked ``"s": "err"``) until it closes."""
        for raw in stream:
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            entry: dict[str, str] = {"t": _now(), "m": text}
            if name == "err":
                entry["s"] = "err"
            record = json.dumps(entry)
            with self.lock:
                self.lines += 1
                if text.strip():
                    self.last[name].append(text[:CAUSE_LINE_MAX])
                if self.written < self.max_bytes:
                    self.out.write(record + "\n")
                    self.out.flush()
                    self.written += len(record) + 1
                    continue
                if len(self.tail) == self.tail.maxlen:
                    self.dropped += 1
                self.tail.append(record)


def _copy_output(proc: subprocess.Popen[bytes], out: IO[str], max_bytes: int) -> _Output:
    """Copy stdout and stderr to out (step 4) until both close; return what was seen."""
    assert proc.stdout is not None and proc.stderr is not None
    output = _Output(out, max_bytes)
    errors = threading.Thread(target=output.copy, args=(proc.stderr, "err"), daemon=True)
    errors.start()
    output.copy(proc.stdout, "out")
    errors.join()
    return output


def _close_output(out: IO[str], dropped: int, tail: collections.deque[str],
                  max_bytes: int) -> None:
    """End out: say how many lines were dropped, then the tail kept."""
    if dropped:
        out.write(json.dumps({"t": _now(), "m": f"[{dropped} output lines dropped: more than "
                                               f"{max_bytes} bytes of output]"}) + "\n")
    out.writelines(record + "\n" for record in tail)
    out.close()


def main(argv: list[str]) -> int:
    """Run the attempt a SPEC describes (the module's steps); return the shim's exit status.

    ``shim.py SPEC``: the command's environment is this process's own. ``shim.py --wait``
    (a warm keeper, started ahead): wait for one line on stdin, ``{"spec": path, "env":
    {...}}``, then run it with that environment; end at once on EOF (the node went away
    before it had a job for this keeper).
    """
    global _OFFSET
    handoff = _handoff(argv)
    if handoff is None:
        return 0
    spec_path, env = handoff
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    _OFFSET = timedelta(seconds=float(spec.get("clock_offset_s", 0.0)))
    out = open(spec["out"], "a", encoding="utf-8")  # closed at the end
    proc = _start(spec, env)
    if proc is None:
        return 0
    started = _now()
    _write_once(spec["started"], {"pid": proc.pid, "at": started, "shim_pid": os.getpid()})
    flags, timer = _arm_stops(proc.pid, float(spec["timeout_s"]))
    max_bytes = int(spec.get("max_bytes", 10 << 20))
    output = _copy_output(proc, out, max_bytes)
    exit_code = proc.wait()
    timer.cancel()
    _close_output(out, output.dropped, output.tail, max_bytes)
    _write_once(spec["exit"], {"exit_code": exit_code, "timed_out": flags["timed_out"],
                               "cancelled": flags["cancelled"], "at": _now(),
                               "lines": output.lines, "dropped": output.dropped,
                               "started_at": started, "err_tail": list(output.last["err"]),
                               "out_tail": list(output.last["out"])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
