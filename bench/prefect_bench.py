"""What the benchmarks share: a throwaway Prefect server, a free port, a wait for a server to
answer, CPU of process trees, a percentile, and the docs section each writes.

Rule: every figure a benchmark reports is CPU time read from ``/proc`` (user +
system, of a process and all its descendants, reaped or alive) or wall time
from ``time.perf_counter``; nothing here reads the server's own metrics.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ops.run_local import stop_group as _stop_group
from ops.run_local import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """Return a TCP port nothing listens on (127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(url: str, *, timeout: float = 2.0) -> bool:
    """Return whether GET url answers 200 now (False when nothing answers in time)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(done: Callable[[], bool], timeout_s: float, *, every: float = 0.3) -> bool:
    """Call done every so many seconds until it holds (True) or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(every)
    return False


def percentile(values: list[float], q: float) -> float:
    """Return the q-quantile of values by nearest rank (NaN when there are none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def server_env(home: Path, port: int, *, late_runs: bool = True) -> dict[str, str]:
    """Return the environment ``make run`` gives its server (ops/run_local.py).

    ``late_runs=False`` turns the late-runs service off, for benchmarks whose
    runs nobody executes (it would mark them Late while they are measured).
    """
    from ops.run_local import server_env as make_run_env
    from sched_node.registration import SERVER_SETTINGS

    env = make_run_env(home, port)
    env.update(SERVER_SETTINGS)  # the nodes' deployments Ready between their polls (make run's)
    env.pop("SCHED_CONFIG", None)
    if not late_runs:
        env["PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED"] = "false"
    return env


def start_server(home: Path, *, late_runs: bool = True, port: int | None = None,
                 uvicorn: tuple[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``prefect server start`` on port (default: a free one); return it and its API URL
    once healthy.

    ``uvicorn=(http, loop)`` starts the same app as ``prefect server start`` starts it in
    the background (``python -m uvicorn --factory prefect.server.api.server:create_app``),
    with that HTTP parser and event loop instead of uvicorn's choice (``auto``: httptools
    and uvloop when installed).
    """
    port = port or free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = server_env(home, port, late_runs=late_runs)
    log = (home / "server.log").open("ab")
    if uvicorn is None:
        command = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                   "127.0.0.1", "--port", str(port)]
    else:
        import prefect

        env["PREFECT__SERVER_FINAL"] = "1"  # as prefect's own background start sets it
        command = [sys.executable, "-m", "uvicorn", "--app-dir",
                   str(Path(prefect.__file__).parent.parent), "--factory",
                   "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                   str(port), "--http", uvicorn[0], "--loop", uvicorn[1]]
    proc = subprocess.Popen(
        command,
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    url = env["PREFECT_API_URL"]
    if wait_healthy(url, proc, timeout_s=180):
        return proc, url
    stop_group(proc, grace_s=0)
    raise SystemExit(f"the Prefect server did not start; see {home / 'server.log'}")


def stop_group(proc: subprocess.Popen[bytes] | None, *, grace_s: float = 20) -> None:
    """SIGTERM proc's process group, wait up to grace_s, then SIGKILL what is left of it."""
    if proc is None or proc.returncode is not None:
        return  # none, or stopped and reaped already: its id may be another process's now
    _stop_group(proc, grace_s, kill_wait_s=10.0)
    try:  # children of the leader (flow-run subprocesses) may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def _stat(pid: int) -> tuple[int, float] | None:
    """Return (parent pid, CPU seconds of the process and its reaped children), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    # After the command: state, ppid, ..., utime (11), stime (12), cutime (13), cstime (14).
    cpu = sum(int(fields[index]) for index in (11, 12, 13, 14)) / TICKS
    return int(fields[1]), cpu


def tree_cpu(pid: int) -> float:
    """Return the CPU seconds (user + system) used so far by pid and all its descendants.

    A child that ended and was reaped counts through its parent's cutime and
    cstime; a live one (or a zombie not yet reaped) counts through its own
    entry. So the sum only grows, and the difference between two readings is
    what the whole tree used in between.
    """
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                stats[int(entry.name)] = found
    children: dict[int, list[int]] = {}
    for child, (parent, _cpu) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += stats[current][1]
        todo.extend(children.get(current, ()))
    return total


def load_text(digits: int = 2) -> str:
    """Return the machine's load averages now (1, 5 and 15 minutes), as ``/proc/loadavg``."""
    return ", ".join(f"{value:.{digits}f}" for value in os.getloadavg())


def machine(*, start: str | None = None) -> str:
    """Return a one-line description of the machine and its load (at the start too, when
    given: :func:`load_text` taken then)."""
    began = f"{start} at the start, " if start else ""
    return (f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores "
            f"shared with other work, load average {began}{load_text(1)} at the end")


def publish(section: str, begin: str, end: str, heading: str, *, write: bool) -> None:
    """Print a benchmark's section, and put it into docs/benchmarks.md when write
    (``--write-docs``): every benchmark's last step."""
    print(section)
    if write:
        write_section(begin, end, heading, section)


def write_section(begin: str, end: str, heading: str, body: str, *, path: Path = DOCS) -> None:
    """Replace the text between begin and end in path, docs/benchmarks.md by default; where
    the markers are missing, append them with body between (under heading, unless empty)."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + (f"\n\n{heading}" if heading else "") + f"\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
