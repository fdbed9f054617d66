"""`sched preview`: next fires with DST moves and suppressions marked."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sched_core.cli import app


def _row(sid: str, hours: list[str], minute: str) -> dict[str, object]:
    return {"id": sid, "name": sid, "repo_id": "r", "action": "backup",
            "schedule": {"days": ["*"], "hours": hours, "minute": minute},
            "miss_policy": "skip", "enabled": True, "version": 1}


def _preview(tmp_path: Path, rows: list[dict[str, object]], *args: str) -> tuple[int, str]:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schedules": rows}))
    result = CliRunner().invoke(app, ["preview", "--schedules", str(path), *args])
    return result.exit_code, result.output


def test_spring_forward_marks_moved_and_skipped_windows(tmp_path: Path) -> None:
    # New York, 2026-03-08: 02:00 EST jumps to 03:00 EDT (07:00Z).
    code, out = _preview(tmp_path, [_row("fixed", ["2"], "30"), _row("wild", ["*"], "30")],
                         "--at", "2026-03-08T00:00", "--days", "1")
    assert code == 0, out
    assert "Sun 2026-03-08 03:00 EDT  (2026-03-08T07:00Z)  <- moved here by DST" in out
    assert "2026-03-08 02:30 moved to 03:00 (DST gap)" in out
    assert "2026-03-08 02:30 skipped: that time does not exist (DST gap)" in out


def test_fall_back_marks_the_suppressed_second_copy(tmp_path: Path) -> None:
    # New York, 2026-11-01: 01:00-01:59 happens as EDT (05:xxZ), then as EST (06:xxZ).
    code, out = _preview(tmp_path, [_row("fixed", ["1"], "30")],
                         "--at", "2026-11-01T00:00", "--days", "1")
    assert code == 0, out
    assert "Sun 2026-11-01 01:30 EDT  (2026-11-01T05:30Z)" in out
    assert "2026-11-01 01:30 EST suppressed: repeated hour" in out
    assert "06:30Z" not in out


def test_invalid_rows_are_reported_and_the_rest_previewed(tmp_path: Path) -> None:
    code, out = _preview(tmp_path, [_row("ok", ["3"], "0"), _row("bad", ["25"], "0")],
                         "--at", "2026-12-01T00:00Z", "--days", "1", "--tz", "UTC")
    assert code == 0
    assert "invalid schedule bad: schedule: hour '25' is not a number from 0 to 23" in out
    assert "Tue 2026-12-01 03:00 UTC" in out


def test_unknown_timezone_is_a_clear_error(tmp_path: Path) -> None:
    code, out = _preview(tmp_path, [], "--tz", "Mars/Olympus")
    assert code != 0 and "unknown timezone 'Mars/Olympus'" in out


def test_policies_are_shown_and_the_windows_they_skip_marked(tmp_path: Path) -> None:
    """Paused until Monday 08:00 EDT, a Wednesday blackout, jitter; a weekly check in Kolkata."""
    backup = {**_row("s-1", ["2"], "30"), "jitter": 1800,
              "paused": {"note": "disk swap", "until": "2026-03-09T12:00:00Z"},
              "blackouts": [{"days": ["wed"], "from": "02:00", "to": "03:00"}]}
    check = {**_row("k-1", ["4"], "0"), "timezone": "Asia/Kolkata", "min_interval": 6 * 86400}
    code, out = _preview(tmp_path, [backup, check], "--at", "2026-03-07T00:00", "--days", "9",
                         "--node", "node-a")
    assert code == 0, out
    lines = out.splitlines()
    assert ("  policies: paused: disk swap (until 2026-03-09 08:00 EDT); blackout wed 02:00-03:00; "
            "jitter 1800 s (this node: +11 min 39 s)") in lines
    assert ("  Sun 2026-03-08 03:00 EDT  (2026-03-08T07:00Z)  <- moved here by DST; skipped: "
            "paused: disk swap (until 2026-03-09 08:00 EDT)") in lines
    assert ("  Tue 2026-03-10 02:30 EDT  (2026-03-10T06:30Z)  <- starts 02:41:39 on node-a "
            "(jitter)") in lines
    assert ("  Wed 2026-03-11 02:30 EDT  (2026-03-11T06:30Z)  <- skipped: in the blackout "
            "wed 02:00-03:00") in lines
    assert "  policies: zone Asia/Kolkata; min_interval 6 d" in lines
    assert "  Sun 2026-03-08 04:00 IST  (2026-03-07T22:30Z)" in lines
    assert ("  Mon 2026-03-09 04:00 IST  (2026-03-08T22:30Z)  <- skipped: min_interval 6 d: the "
            "last fire (2026-03-08 04:00 IST) was 1 d before") in lines
    assert "  Sat 2026-03-14 04:00 IST  (2026-03-13T22:30Z)" in lines
    # Without a node, jitter is named but no node's start is made up.
    code, out = _preview(tmp_path, [backup], "--at", "2026-03-07T00:00", "--days", "5")
    assert "jitter 1800 s (each node its own offset)" in out and "starts " not in out
