"""Run an action's command without a shell, in the environment the action declares.

Rule: :func:`run_command` never uses a shell: argv (rendered and checked by
:func:`sched_core.render.render_argv`) goes to ``exec`` as is.

Rule: a job's command never inherits the agent's environment. Its whole
environment is :func:`job_environment`'s: the few variables of
JOB_BASE_VARIABLES the agent has (``PATH``, ``HOME``, ``USER``, ``LOGNAME``,
``LANG``, ``LC_ALL``, ``LC_CTYPE``, ``TMPDIR``; ``PATH`` defaults to
DEFAULT_PATH), ``TZ`` (the row's zone, else ``UTC``), then the action's
declared ``env`` over them. So the agent's credentials (``SCHED_TOKEN``,
``PREFECT_API_AUTH_STRING``, ``PREFECT_API_KEY``, ``PREFECT_API_URL`` with its
password, ``AWS_*``, ...) never reach a command or its output in the run's log;
an action that needs a variable declares it. :func:`run_command` passes the
environment it is given as the whole environment.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sched_core import ConfigError

JOB_BASE_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR")
"""The agent's variables a job's command gets (when the agent has them): nothing secret."""

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
"""A job's ``PATH`` when the agent has none."""


def job_environment(
    declared: Mapping[str, str], *, tz: str, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Return a job command's whole environment: base's JOB_BASE_VARIABLES, TZ, then declared.

    ``tz`` is the row's zone (``UTC`` when empty); ``declared`` is the action's
    ``env``, which wins over the rest. Nothing else of ``base`` (the agent's
    environment, with its tokens) is passed on.
    """
    env = {name: base[name] for name in JOB_BASE_VARIABLES if base.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env["TZ"] = tz or "UTC"
    env.update(declared)
    return env


@dataclass(frozen=True)
class CommandResult:
    """What a command did: its exit code (negative: killed by that signal) and duration."""

    argv: list[str]
    exit_code: int
    duration_s: float
    timed_out: bool
    output_lines: int


def run_command(
    argv: list[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    log: Callable[[str], object] | None = None,
    umask: int = 0o077,
) -> CommandResult:
    """Run argv without a shell, passing each output line to log; kill its group on timeout.

    ``env`` is the command's whole environment (see :func:`job_environment`;
    None gives it ``job_environment({}, tz="UTC")``): the agent's own is never
    merged in. The command runs with umask (default 077: the files it creates
    are the agent user's alone); the agent's own umask is left as it is.

    Raises ConfigError when the program cannot be started (not found, not executable).
    """
    emit = log or logging.getLogger(__name__).info
    started = time.monotonic()
    proc = _spawn(argv, env=env, cwd=cwd, umask=umask)
    timed_out = threading.Event()
    kill = functools.partial(_kill_timed_out, proc.pid, timed_out)
    timer = threading.Timer(timeout_s, kill)
    timer.daemon = True
    timer.start()
    exit_code, lines = _follow(proc, emit, timer, kill)
    return CommandResult(
        argv=argv,
        exit_code=exit_code,
        duration_s=round(time.monotonic() - started, 3),
        timed_out=timed_out.is_set(),
        output_lines=lines,
    )


def _spawn(argv: list[str], *, env: Mapping[str, str] | None, cwd: Path | None,
           umask: int) -> subprocess.Popen[str]:
    """Start argv in a session of its own, its output as text lines; ConfigError if it cannot."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else job_environment({}, tz="UTC"),
            cwd=cwd,
            start_new_session=True,
            umask=umask,
            text=True,
            errors="replace",
            bufsize=1,
        )
    except OSError as exc:
        raise ConfigError(f"cannot start {argv[0]!r}: {exc}") from exc


def _kill_timed_out(pid: int, timed_out: threading.Event) -> None:
    """Say the command timed out and SIGKILL its process group."""
    timed_out.set()
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _follow(proc: subprocess.Popen[str], emit: Callable[[str], object],
            timer: threading.Timer, kill: Callable[[], None]) -> tuple[int, int]:
    """Pass each output line to emit until the command exits; return its exit code and the
    lines seen. However this ends, the timer stops and a command still running is killed."""
    lines = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines += 1
            emit(line.rstrip("\n"))
        exit_code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return exit_code, lines
