"""Agent settings and the action table: pure, no Prefect server."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sched_core import ConfigError, LocalSchedule
from sched_core.render import render_argv
from sched_node.actions import run_command
from sched_node.settings import ActionSpec, load_settings

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
node_name = "node-a"
pull_url = "schedules.json"
state_dir = "state"
grace = 120

[actions.backup]
argv = ["tar", "-czf", "{state_dir}/{repo_id}-{window}.tar.gz", "-C", "{param:source}", "."]
timeout = 60
retries = 2
env = { TZ = "UTC" }

[[stages]]
name = "prune"
action = "prune"
"""


def _row(**params: object) -> LocalSchedule:
    return LocalSchedule.model_validate({
        "id": "s-1", "name": "n", "repo_id": "r-9", "action": "backup",
        "schedule": {"days": ["*"], "hours": ["*"], "minute": "0"},
        "miss_policy": "skip", "enabled": True, "params": params or None,
    })


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("SCHED_CONFIG", "SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "agent.toml"
    path.write_text(CONFIG)
    return path


def test_toml_file_named_by_env_and_relative_paths(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHED_CONFIG", str(config))
    settings = load_settings()
    assert settings.node_name == "node-a"
    assert settings.pull_url == (config.parent / "schedules.json").as_uri()
    assert settings.state_dir == config.parent / "state" and settings.state_dir.is_dir()
    assert settings.grace == timedelta(minutes=2)
    assert settings.actions["backup"].retries == 2
    assert settings.wave == ["backup", "copy"]
    assert [stage.name for stage in settings.stages] == ["prune"]
    assert settings.stages[0].key() == "chain-prune"


def test_env_overrides_the_file_field_by_field(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHED_NODE_NAME", "node-b")
    monkeypatch.setenv("SCHED_ACTIONS__BACKUP__TIMEOUT", "30")
    monkeypatch.setenv("SCHED_TOKEN", "s3cret")
    settings = load_settings(config)
    assert settings.node_name == "node-b"
    assert settings.actions["backup"].timeout == timedelta(seconds=30)
    assert settings.actions["backup"].retries == 2  # the rest of the table stays
    assert settings.bearer_token() == "s3cret"
    assert "s3cret" not in repr(settings)


def test_defaults_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    settings = load_settings(pull_url="https://controller/api/schedules?node=a")
    assert settings.timezone == "America/New_York"
    assert settings.grace == timedelta(minutes=5)
    assert [(s.name, s.action, s.on) for s in settings.stages] == [
        ("prune", "prune", "after_wave"), ("check", "check", "after_wave"),
    ]
    assert settings.state_dir == tmp_path / ".state"
    assert settings.listen is True
    monkeypatch.setenv("SCHED_LISTEN", "0")
    assert load_settings(pull_url="https://controller/api/schedules?node=a").listen is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"timezone": "Mars/Base"}, "unknown timezone 'Mars/Base'"),
        ({"actions": {"b": {"argv": ["x", "{repo}"]}}}, "unknown field {repo}"),
        ({"actions": {"b": {"argv": ["x", "{param}"]}}}, "{param:NAME}"),
        ({"actions": {"b": {"argv": []}}}, "actions.b.argv"),
        ({"actions": {"b": {"argv": ["x"], "shell": True}}}, "actions.b.shell"),
        ({"node_name": "a/b"}, "must not contain '/'"),
    ],
)
def test_invalid_settings_name_the_field(
    config: Path, override: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_settings(config, **override)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("node_name = [")
    with pytest.raises(ConfigError, match="cannot read agent settings"):
        load_settings(bad)


def test_render_fills_schedule_fields_and_params() -> None:
    spec = ActionSpec(argv=["tool", "--repo={repo_id}", "{param:threads}", "{param:fast}",
                            "-exec", "x", "{{}}", "{window}", "{state_dir}/{node}"],
                      strict_params=False)  # undeclared params: text, after the common checks
    argv = render_argv(
        spec, _row(threads=4.0, fast=True), state_dir=Path("/st"), node="n",
        window=datetime(2026, 12, 2, 7, 30, tzinfo=UTC), trigger_key="schedule",
    )
    assert argv == ["tool", "--repo=r-9", "4", "true", "-exec", "x", "{}", "20261202T0730Z",
                    "/st/n"]


@pytest.mark.parametrize(
    ("template", "row", "message"),
    [
        ("{param:source}", _row(), "no parameter 'source'"),
        ("{param:source}", _row(source=["a"]), "is a list"),
        ("{storage}", _row(), "has no storage"),
    ],
)
def test_render_rejects_missing_values_before_running(
    template: str, row: LocalSchedule, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render_argv(ActionSpec(argv=["x", template], strict_params=False), row,
                    state_dir=Path("/st"), node="n", window=None, trigger_key="manual")


def test_run_command_uses_no_shell_and_streams_output() -> None:
    lines: list[str] = []
    result = run_command(
        [sys.executable, "-c", "import sys; print('one'); print(sys.argv[1:]); sys.exit(3)",
         "$HOME; echo pwned"],
        timeout_s=30, env={"X": "1"}, log=lines.append,
    )
    assert result.exit_code == 3 and not result.timed_out
    assert lines == ["one", "['$HOME; echo pwned']"]


def test_run_command_kills_on_timeout() -> None:
    result = run_command([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert result.timed_out and result.exit_code < 0 and result.duration_s < 10


def test_run_command_missing_program() -> None:
    with pytest.raises(ConfigError, match="cannot start 'no-such-program-x'"):
        run_command(["no-such-program-x"], timeout_s=5)


@pytest.mark.parametrize("name", ["agent.toml", "agent-restic.toml"])
def test_shipped_examples_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHED_NODE_NAME", raising=False)
    settings = load_settings(ROOT / "examples" / name, state_dir="/tmp/sched-example-test")
    assert {"backup", "prune", "check"} <= set(settings.actions)
