"""State files: a start removes only its own stale temporaries; the kit's import is light."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sched_core.chain import Chain, Spec, Stage
from sched_core.statefile import STALE_AFTER, remove_stale_temporaries, write_atomic
from tests.test_scheduler import T0, Agent, row


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def _litter(folder: Path, name: str) -> dict[str, Path]:
    """Files around a state file called name: its temporaries (old and fresh) and others."""
    old = STALE_AFTER.total_seconds() + 60
    files = {
        "stale": folder / f"{name}.abc_1234.tmp",
        "stale2": folder / f"{name}.zz9zz9zz.tmp",
        "fresh": folder / f"{name}.fresh123.tmp",  # a live writer's, maybe
        "other": folder / "other.json.abc_1234.tmp",
        "lock": folder / f"{name}.lock",
        "aside": folder / f"{name}.corrupt-20261130T150000000000",
        "not-mkstemp": folder / f"{name}.toolongname.tmp",
        "upper": folder / f"{name}.ABCD1234.tmp",
        "user": folder / "notes.tmp",
    }
    for key, path in files.items():
        path.write_text(key)
        if key != "fresh":
            _age(path, old)
    folder_like = folder / f"{name}.dir12345.tmp"
    folder_like.mkdir()
    files["dir"] = folder_like
    link = folder / f"{name}.link1234.tmp"
    link.symlink_to(files["user"])
    _age(link, old)
    files["link"] = link
    return files


def test_only_a_files_own_old_temporaries_are_removed(tmp_path: Path) -> None:
    files = _litter(tmp_path, "cache.json")
    removed = remove_stale_temporaries(tmp_path / "cache.json")
    assert sorted(p.name for p in removed) == sorted(
        files[k].name for k in ("stale", "stale2")
    )
    kept = {key for key, path in files.items() if path.exists() or path.is_symlink()}
    assert kept == set(files) - {"stale", "stale2"}
    assert files["user"].read_text() == "user"  # the symlink's target is untouched


def test_a_scheduler_start_removes_its_caches_stale_temporaries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = _litter(tmp_path, "cache.json")
    agent = Agent(tmp_path, [row("a")])
    assert not files["stale"].exists() and not files["stale2"].exists()
    assert files["fresh"].exists() and files["other"].exists() and files["lock"].exists()
    assert any("stale temporary" in r.getMessage() for r in caplog.records)
    agent.scheduler.pull(now=T0)  # and the cache works as ever
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


def test_a_chain_start_removes_its_markers_stale_temporaries(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    files = _litter(tmp_path, "chain.json")
    Chain(agent.scheduler, Spec(
        stages=[Stage(name="prune", trigger_key="chain-prune", match=lambda s: False,
                      active=lambda: False)],
        is_wave_job=lambda action: action == "backup", wave_complete=lambda: True,
        marker_path=tmp_path / "chain.json",
    ))
    assert not files["stale"].exists() and not files["stale2"].exists()
    assert files["fresh"].exists() and files["other"].exists()


def test_a_write_leaves_no_temporary_behind(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_importing_the_kit_loads_neither_httpx_nor_the_shell() -> None:
    code = (
        "import sys, sched_core\n"
        "from sched_core import next_fire, Schedule, LocalSchedule, check_identifier\n"
        "loaded = [m for m in ('httpx', 'sched_core.scheduler', 'sched_core.statefile',"
        " 'sched_core.chain', 'threading_loops') if m in sys.modules]\n"
        "assert loaded == [], loaded\n"
        "from sched_core import Scheduler\n"
        "assert 'sched_core.scheduler' in sys.modules and 'httpx' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "content",
    ['{"stages": {"prune": {"date": "2026-11-30", "fired_at": NaN}}}',
     '{"stages": ' + "[" * 5000 + "]" * 5000 + "}",
     '{"stages": {"\\ud800": {"date": "2026-11-30"}}}'],
)
def test_a_marker_file_breaking_a_wire_rule_is_moved_aside(tmp_path: Path, content: str) -> None:
    agent = Agent(tmp_path, [row("p", action="prune", schedule={"on": "after_wave"})])
    agent.scheduler.pull(now=T0)
    marker = tmp_path / "chain.json"
    marker.write_text(content)
    chain = Chain(agent.scheduler, Spec(
        stages=[Stage(name="prune", trigger_key="chain-prune",
                      match=lambda s: s.action == "prune", active=lambda: False)],
        is_wave_job=lambda action: action == "backup", wave_complete=lambda: True,
        marker_path=marker,
    ))
    assert chain.on_job_complete("backup", now=T0) == ["prune"]
    (aside,) = tmp_path.glob("chain.json.corrupt-*")
    assert aside.read_text() == content
    assert set(chain.marks(now=T0)) == {"prune"}
