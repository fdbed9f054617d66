"""The examples of the README and docs/, run as a new user runs them: the blocks that can run here.

The `sched preview` example must print exactly what docs/kit.md shows; the `sched`
transcript is compared line by line with the dates, the current time, seconds ago and
EST/EDT masked (it runs at whatever time the suite does); the two `curl` examples run whole in
bash against a real controller (and, for the events they send, a real Prefect server),
on a free port instead of 8080.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from tests.procs import free_port
from tests.test_controller_cli import serving

ROOT = Path(__file__).resolve().parents[1]
PAGES = "\n".join(path.read_text(encoding="utf-8")
                  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
BIN = Path(sys.executable).parent


def blocks() -> list[str]:
    """Return the body of every fenced block of the README and docs/."""
    return re.findall(r"^```[a-z]*\n(.*?)^```$", PAGES, flags=re.MULTILINE | re.DOTALL)


def block_with(text: str) -> str:
    found = [body for body in blocks() if text in body]
    assert len(found) == 1, f"{len(found)} blocks of the docs hold {text!r}"
    return found[0]


def transcript(body: str) -> list[tuple[str, list[str]]]:
    """Split a `$ command` / output block into (command, expected lines) pairs."""
    steps: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        assert line.startswith("$ "), f"transcript line outside a command: {line!r}"
        command = line[2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        i += 1
        output: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        steps.append((command, output))
    return steps


def user_env(**extra: str) -> dict[str, str]:
    """A new user's shell: no SCHED_* or Prefect settings of the suite, `sched` on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SCHED_", "PREFECT_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def masked(line: str) -> str:
    """The line without what depends on when it runs (the date, the clock, UTC's offset)."""
    line = re.sub(r"\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun)\b", "Day", line)
    line = re.sub(r"\b\d{4}-\d\d-\d\d\b", "DATE", line)
    line = re.sub(r"\b\d\d:\d\d( UTC|Z)", r"HH:MM\1", line)  # "now", or 04:30 local in UTC
    line = re.sub(r"\bE[SD]T\b", "E?T", line)
    line = re.sub(r"\b\d+ s\b", "N s", line)  # seconds ago
    return " ".join(line.split())


def assert_lines(command: str, expected: list[str], actual: list[str]) -> None:
    assert len(actual) == len(expected), (command, expected, actual)
    for want, got in zip(expected, actual, strict=True):
        if want.endswith("..."):
            assert masked(got).startswith(masked(want[:-3])), (command, want, got)
        else:
            assert masked(got) == masked(want), (command, want, got)


def test_the_preview_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    steps = transcript(block_with("$ sched preview"))
    assert [command for command, _ in steps] == [
        "cat schedules.json",
        "sched preview --schedules schedules.json --at 2026-03-08T00:00 --days 1",
    ]
    (tmp_path / "schedules.json").write_text("\n".join(steps[0][1]) + "\n")
    for command, expected in steps:
        result = subprocess.run(shlex.split(command), cwd=tmp_path, env=user_env(),
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == expected  # exact: the example has no clock


def _dst_change_within(hours: int) -> bool:
    zone = ZoneInfo("America/New_York")
    now = datetime.now(UTC)
    return now.astimezone(zone).utcoffset() != (now + timedelta(hours=hours)).astimezone(
        zone).utcoffset()


def test_the_sched_transcript_runs_as_shown(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if _dst_change_within(48):
        pytest.skip("a DST change in the next 48 h adds a window to `sched upcoming --hours 24`")
    steps = transcript(block_with("$ sched schedules put s-1"))
    assert steps[0][0].startswith("sched schedules put s-1 --node node-a")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # the transcript's controller has none
    with serving(tmp_path, "--api-only", SCHED_ADMIN_TOKEN="adm",
                 SCHED_NODE_TOKENS="node-a=ta") as (base, _log):
        env = user_env(SCHED_CONTROLLER_URL=base, SCHED_TOKEN="adm")
        for n, (command, expected) in enumerate(steps):
            result = subprocess.run(shlex.split(command), cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=60, check=False)
            assert result.returncode == 0, (command, result.stdout, result.stderr)
            assert_lines(command, expected, result.stdout.splitlines())
            if n == 0:  # "node-a's agent pulled once between the first two commands"
                pull = httpx.get(f"{base}/api/schedules", params={"node": "node-a"},
                                 headers={"Authorization": "Bearer ta"}, timeout=30)
                assert pull.status_code == 200, pull.text


def run_block(body: str, cwd: Path, env: dict[str, str]) -> str:
    """Run a shell block of the docs in bash, then stop the controller it started."""
    script = body + '\nkill "$!"\nwait "$!" || true\n'
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    return out


def json_answers(out: str) -> list[dict[str, Any]]:
    """Every JSON object curl printed, in order (its answers end without a newline)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    i = 0
    while (i := out.find("{", i)) != -1:
        try:
            value, end = decoder.raw_decode(out, i)
        except json.JSONDecodeError:
            i += 1
            continue
        found.append(value)
        i = end
    return found


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def _prepared(body: str, prefect_server: str) -> tuple[str, int]:
    port = free_port()
    assert "http://127.0.0.1:4200/api" in body and "8080" in body
    return (body.replace("http://127.0.0.1:4200/api", prefect_server)
                .replace("8080", str(port)), port)


@needs_curl
def test_the_first_controller_example_runs(tmp_path: Path, prefect_server: str) -> None:
    body, _port = _prepared(block_with("sched controller serve --port 8080 &"), prefect_server)
    out = run_block(body, tmp_path, user_env())
    assert "migrated sqlite:///" in out and ".data/controller.db" in out, out
    answers = json_answers(out)
    row = answers[0]
    assert row["id"] == "s-1" and row["version"] == 1, out
    assert row["schedule"] == {"days": ["mon", "tue"], "hours": ["2"], "minute": "30"}
    assert row["params"] == {"threads": 4}
    assert row["_propagation"]["event_sent"] is True, row
    heads = re.findall(r"^HTTP/1\.1 (\d{3})", out, flags=re.MULTILINE)
    assert heads == ["200", "304"], out  # the read with its ETag, then If-None-Match's 304
    etags = re.findall(r"^etag: (\S+)", out, flags=re.MULTILINE | re.IGNORECASE)
    assert len(etags) == 2 and etags[0].startswith('"') and len(set(etags)) == 1, etags
    task = answers[-1]
    assert task["cron"] == "0 6 * * *" and task["event"] == "sched.task.report.daily", task
    assert task["payload"] == {"to": "ops"} and task["status"] == "active", task


@needs_curl
def test_the_fleet_example_answers_as_the_comments_show(tmp_path: Path,
                                                         prefect_server: str) -> None:
    raw = block_with("--api-only --port 8080 --pull-interval 900 &")
    body, _port = _prepared(raw, prefect_server)
    out = run_block(body, tmp_path, user_env())
    answers = json_answers(out)
    assert len(answers) == 6, out  # PUT, PATCH, PATCH, status, node status, upcoming
    put, pause, resume, status, node, upcoming = answers
    propagation = put["_propagation"]
    assert propagation["event_sent"] is True and propagation["node_silent"] is True, propagation
    assert propagation["likely_in_time"] is False, propagation
    assert propagation["reason"] == (
        "node node-a has never made a request to this controller with its own token; "
        f"event sched.schedules.updated accepted by {prefect_server}"), propagation
    assert pause["paused"] == {"note": "disk swap, INC-4711"} and "paused" not in resume
    assert [n["node"] for n in status["nodes"]] == ["node-a"]
    assert node["schedules"][0]["when"] == "daily at 02:30"
    assert len(node["schedules"][0]["next_windows"]) == 10
    assert [w["schedule_id"] for w in upcoming["windows"]] == ["s-1"]
    # Every field the example's comments show is in the real answers.
    commented = "\n".join(line for line in raw.splitlines() if line.startswith("#"))
    shown = set(re.findall(r'"([a-z_]+)":', commented))
    real = set(re.findall(r'"([a-z_]+)":', out))
    assert shown and shown <= real, shown - real
