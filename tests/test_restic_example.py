"""The restic example (agent-restic.toml, restic-schedules.json) through the action code.

The render test is pure and always runs. The live test runs backup, copy,
forget --prune and check with the real ``restic`` against temporary local
repositories, exactly as ``run-job`` does (``render_argv`` then
``run_command``); it skips when ``restic`` is not on PATH (CI does not have it;
on Debian: ``apt-get install restic``).
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sched_core import LocalSchedule
from sched_core.render import render_argv
from sched_node.actions import job_environment, run_command
from sched_node.settings import AgentSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "agent-restic.toml"
ROWS = ROOT / "examples" / "restic-schedules.json"
WINDOW = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)
ACTIONS = ("backup", "copy", "prune", "check")


def _rows() -> dict[str, dict[str, Any]]:
    rows = json.loads(ROWS.read_text())["schedules"]
    return {row["action"]: row for row in rows}


def _settings(tmp: Path, *, password: Path | None = None) -> AgentSettings:
    """Load a copy of the example with its node paths (and, with password, roots) under tmp."""
    text = EXAMPLE.read_text()
    if password is not None:
        text = text.replace("/etc/sched-agent/restic-password", str(password))
        text = text.replace("/var/cache/restic", str(tmp / "cache"))
        # The declared roots: what may be backed up, the repositories, the off-site copies.
        for root in ("/srv/data", "/srv/restic", "/mnt/offsite/restic"):
            assert f'"{root}"' in text, root
        text = text.replace('"/srv/data"', f'"{tmp / "data"}"')
        text = text.replace('"/srv/restic"', f'"{tmp / "repo"}"')
        text = text.replace('"/mnt/offsite/restic"', f'"{tmp / "offsite"}"')
    config = tmp / "agent.toml"
    config.write_text(text)
    return load_settings(config, state_dir=str(tmp / "state"), node_name="backup-01")


def _argv(settings: AgentSettings, row: dict[str, Any]) -> list[str]:
    return render_argv(
        settings.action(row["action"]),
        LocalSchedule.model_validate(row),
        state_dir=settings.state_dir,
        node=settings.node_name,
        window=WINDOW,
        trigger_key="schedule",
    )


def test_every_action_renders_for_the_sample_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHED_NODE_NAME", raising=False)
    settings = _settings(tmp_path)
    rows = _rows()
    assert set(rows) == set(settings.actions) == set(ACTIONS)
    rendered = {action: _argv(settings, rows[action]) for action in ACTIONS}
    assert rendered == {
        "backup": ["restic", "--repo", "/srv/restic/r-9", "backup", "--tag", "r-9",
                   "--host", "backup-01", "--one-file-system", "--", "/home"],
        "copy": ["restic", "--repo", "/mnt/offsite/restic/r-9", "copy",
                 "--from-repo", "/srv/restic/r-9", "--tag", "r-9"],
        "prune": ["restic", "--repo", "/srv/restic/r-9", "forget", "--tag", "r-9",
                  "--keep-daily", "7", "--keep-weekly", "4", "--prune"],
        "check": ["restic", "--repo", "/srv/restic/r-9", "check", "--read-data-subset", "10%"],
    }
    # The chain's stages fire the after_wave rows; the wave's rows are on the clock.
    assert [stage.action for stage in settings.stages] == ["prune", "check"]
    assert {a for a, row in rows.items() if row["schedule"].get("on") == "after_wave"} == {
        "prune", "check"
    }
    assert set(settings.wave) == {"backup", "copy"}


def _restic(args: list[str], env: dict[str, str], lines: list[str]) -> None:
    result = run_command(["restic", *args], timeout_s=120, env=job_environment(env, tz="UTC"),
                         log=lines.append)
    assert result.exit_code == 0, "\n".join(lines)


def _snapshots(repo: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    lines: list[str] = []
    _restic(["--repo", str(repo), "snapshots", "--json"], env, lines)
    found: list[dict[str, Any]] = json.loads("".join(lines))
    return found


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("restic") is None,
    reason="restic is not on PATH (a by-hand check: apt-get install restic)",
)
def test_backup_copy_prune_check_with_real_restic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SCHED_NODE_NAME", "RESTIC_REPOSITORY", "RESTIC_PASSWORD",
                 "RESTIC_FROM_REPOSITORY", "RESTIC_FROM_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    password = tmp_path / "restic-password"
    password.write_text("correct horse battery staple\n")
    password.chmod(0o600)
    repo, offsite, data = tmp_path / "repo", tmp_path / "offsite", tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("first\n")
    (data / "sub" / "b.bin").write_bytes(bytes(range(256)) * 800)
    settings = _settings(tmp_path, password=password)
    env = settings.actions["backup"].env
    assert env["RESTIC_PASSWORD_FILE"] == str(password)
    lines: list[str] = []
    _restic(["init", "--repo", str(repo)], env, lines)
    _restic(["init", "--repo", str(offsite), "--from-repo", str(repo),
             "--copy-chunker-params"], {**env, "RESTIC_FROM_PASSWORD_FILE": str(password)}, lines)

    rows = _rows()
    for row in rows.values():
        row["storage"] = str(repo)
    rows["backup"]["params"]["path"] = str(data)
    rows["copy"]["params"]["copy_to"] = str(offsite)

    def run(action: str) -> list[str]:
        spec = settings.action(action)
        out: list[str] = []
        result = run_command(
            _argv(settings, rows[action]), timeout_s=spec.timeout.total_seconds(),
            env=job_environment(spec.env, tz="UTC"), cwd=spec.cwd, log=out.append,
        )
        assert result.exit_code == 0 and not result.timed_out, (action, "\n".join(out))
        return out

    run("backup")
    (data / "a.txt").write_text("second\n")
    run("backup")
    assert len(_snapshots(repo, env)) == 2
    run("copy")
    copied = run("copy")  # again: nothing new to copy
    assert any("already copied" in line for line in copied), copied
    assert len(_snapshots(offsite, env)) == 2
    # keep_daily 7 keeps the newest snapshot of each day: the older one goes.
    pruned = "\n".join(run("prune"))
    assert "remove 1 snapshots" in pruned and "running prune" in pruned, pruned
    left = _snapshots(repo, env)
    assert len(left) == 1 and left[0]["tags"] == ["r-9"] and left[0]["hostname"] == "backup-01"
    checked = run("check")
    assert any("no errors were found" in line for line in checked), checked
    assert any("10.0% of data packs" in line for line in checked), checked
