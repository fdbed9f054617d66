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
