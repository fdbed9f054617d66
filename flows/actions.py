"""The action table at work: fill an argv template from a schedule, run it without a shell.

Rule: :func:`render_argv` checks everything before anything runs, so a template
naming a missing parameter fails the job with a clear error and no process
started. :func:`run_command` never uses a shell: argv goes to ``exec`` as is.
"""

from __future__ import annotations

import logging
import os
import signal
import string
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flows.settings import ActionSpec, template_fields
from sched_core import ConfigError, LocalSchedule


def window_stamp(window: datetime | None) -> str:
    """Return a window as a compact UTC stamp for names and file names: 20261202T0730Z.

    A window without a UTC offset is a ConfigError: reading it in the machine's
    local time would name (and write) a different window on every host.
    """
    if window is not None and (window.tzinfo is None or window.utcoffset() is None):
        raise ConfigError(
            f"window {window.isoformat()} has no UTC offset; give one, "
            f"such as {window.isoformat()}Z or {window.isoformat()}-05:00"
        )
    return (window or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%MZ")


def _param_text(schedule: LocalSchedule, name: str) -> str:
    params: Mapping[str, Any] = schedule.params or {}
    if name not in params or params[name] is None:
        raise ConfigError(
            f"schedule {schedule.id!r} ({schedule.action}) has no parameter {name!r} "
            f"that its argv template names as {{param:{name}}}"
        )
    value = params[name]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(
        f"schedule {schedule.id!r}: parameter {name!r} is a {type(value).__name__}, "
        "not a string, number or bool"
    )


def render_argv(
    spec: ActionSpec,
    schedule: LocalSchedule,
    *,
    state_dir: Path,
    node: str,
    window: datetime | None,
    trigger_key: str,
) -> list[str]:
    """Return the argv of spec filled from schedule; ConfigError names any missing value."""
    values: dict[str, str] = {
        "repo_id": schedule.repo_id,
        "storage": schedule.storage,
        "state_dir": str(state_dir),
        "node": node,
        "schedule_id": schedule.id,
        "action": schedule.action,
        "window": window_stamp(window),
        "trigger_key": trigger_key,
    }
    argv: list[str] = []
    for template in spec.argv:
        fields = dict.fromkeys(name for name, _ in template_fields(template))
        for required in ("repo_id", "storage"):
            if required in fields and not values[required]:
                raise ConfigError(
                    f"schedule {schedule.id!r} ({schedule.action}) has no {required} "
                    f"but its argv template {template!r} names {{{required}}}"
                )
        out: list[str] = []
        for literal, field, spec_text, _conv in _parse(template):
            out.append(literal)
            if field is None:
                continue
            out.append(_param_text(schedule, spec_text) if field == "param" else values[field])
        argv.append("".join(out))
    return argv


def _parse(template: str) -> list[tuple[str, str | None, str, str | None]]:
    return [
        (literal, name, spec or "", conv)
        for literal, name, spec, conv in string.Formatter().parse(template)
    ]


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
) -> CommandResult:
    """Run argv without a shell, passing each output line to log; kill its group on timeout.

    Raises ConfigError when the program cannot be started (not found, not executable).
    """
    emit = log or logging.getLogger(__name__).info
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
            text=True,
            errors="replace",
            bufsize=1,
        )
    except OSError as exc:
        raise ConfigError(f"cannot start {argv[0]!r}: {exc}") from exc
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, _kill)
    timer.daemon = True
    timer.start()
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
            _kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return CommandResult(
        argv=argv,
        exit_code=exit_code,
        duration_s=round(time.monotonic() - started, 3),
        timed_out=timed_out.is_set(),
        output_lines=lines,
    )
