"""``sched agent check CONFIG``: an agent config read as the node would, before a restart,
writing nothing (the morning-answer issue: a typo used to stop a node with no trace at the
center; now it can be caught before the restart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.nodekit import ACTIONS, row

SCHED = str(Path(sys.executable).parent / "sched")


def _config(folder: Path, extra: str = "") -> Path:
    config = folder / "agent.toml"
    config.write_text(f'node_name = "chk"\npull_url = "schedules.json"\nstate_dir = "state"\n'
                      f'timezone = "UTC"\n{extra}\n' + ACTIONS)
    return config


def _check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCHED, "agent", "check", str(config)], capture_output=True,
                          text=True, timeout=60, check=False)


def test_a_good_config_starts_and_nothing_is_written(tmp_path: Path) -> None:
    done = _check(_config(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node chk" in done.stdout and "actions: check, echo, env, fail, prune" in done.stdout
    assert "no cached schedules yet" in done.stdout
    assert not (tmp_path / "state").exists(), "check wrote the state folder"


def test_a_typo_would_not_start_the_node_and_names_the_setting(tmp_path: Path) -> None:
    done = _check(_config(tmp_path, 'timezon = "UTC"'))
    assert done.returncode == 2
    assert "would not start" in done.stderr and "timezon: Extra inputs are not permitted" in (
        done.stderr)


def test_cached_schedules_the_action_table_refuses_are_named(tmp_path: Path) -> None:
    config = _config(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    bad = row("s-2", sleep=9999)  # over the echo action's max of 600
    (state / "cache.json").write_text(json.dumps({
        "schedules": [row("s-1"), bad, {**row("s-3"), "action": "nope"}]}))
    done = _check(config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 cached schedule(s): 1 render a command, 2 would fail" in done.stdout
    assert "s-2 (test s-2):" in done.stdout and "sleep" in done.stdout
    assert "s-3 (test s-3):" in done.stdout and "nope" in done.stdout
