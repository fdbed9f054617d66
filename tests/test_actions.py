"""The action table's value rules: declarations, render-time checks, the job's umask.

Pure except the umask and state-folder tests, which create files in tmp_path
and run a real ``python`` child. The attacks themselves (shipped tables,
run-job on a real server) are in tests/test_attacks.py.
"""

from __future__ import annotations

import os
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sched_core import ConfigError, LocalSchedule
from sched_core.render import ValueRefused, render_argv
from sched_node.actions import run_command
from sched_node.settings import ActionSpec, load_settings

WINDOW = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)


def _row(repo_id: str = "r-9", storage: str = "", sid: str = "s-1", **params: Any) -> LocalSchedule:
    return LocalSchedule.model_validate({
        "id": sid, "name": "n", "repo_id": repo_id, "action": "backup", "storage": storage,
        "schedule": {"days": ["*"], "hours": ["*"], "minute": "0"},
        "miss_policy": "skip", "enabled": True, "params": params or None,
    })


def _render(spec: ActionSpec, row: LocalSchedule, *, node: str = "node-a",
            trigger_key: str = "schedule", state_dir: Path = Path("/st")) -> list[str]:
    return render_argv(spec, row, state_dir=state_dir, node=node, window=WINDOW,
                       trigger_key=trigger_key)


def _spec(*argv: str, **decl: Any) -> ActionSpec:
    return ActionSpec.model_validate({"argv": list(argv), **decl})


# -- declarations, checked when the settings load --------------------------------------


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"params": {"p": {"type": "float"}}}, "actions.b.params.p.type"),
        ({"params": {"p": {"type": "int", "pattern": "x"}}},
         "actions.b.params.p: Value error, pattern applies to type = 'string' only"),
        ({"params": {"p": {"type": "string", "pattern": "("}}}, "is not a valid regex"),
        ({"params": {"p": {"type": "string", "allow_dash": True}}},
         "allow_dash needs a pattern or choices"),
        ({"params": {"p": {"type": "path"}}}, 'type = "path" needs under'),
        ({"params": {"p": {"type": "int", "min": 5, "max": 1}}}, "min 5 is above max 1"),
        ({"params": {"p": {"type": "string", "choices": []}}}, "choices is empty"),
        ({"params": {"p": {"type": "string", "max_length": 5000}}},
         "actions.b.params.p.max_length"),
        ({"params": {"p": {"type": "string", "roots": ["/x"]}}}, "actions.b.params.p.roots"),
        ({"fields": {"repo": {"type": "string"}}}, "'repo' is no row field"),
        ({"fields": {"storage": {"type": "int"}}}, "storage: a row field is text"),
        ({"argv": ["{param:prog}", "x"]}, "must be a fixed program"),
        ({"argv": ["x", "{state_dir}/{param:p}"], "params": {"p": {"type": "path",
                                                                    "under": ["/"]}}},
         "{param:p} is declared a path"),
    ],
)
def test_bad_declarations_name_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: dict[str, Any], message: str
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    body = {"argv": ["x", "{param:p}"], **action}
    with pytest.raises(ConfigError, match="invalid agent settings") as caught:
        load_settings(pull_url="x.json", state_dir=str(tmp_path / "st"), actions={"b": body})
    assert message in str(caught.value)


def test_declarations_load_from_toml_with_roots_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SCHED_CONFIG", "SCHED_STRICT_PARAMS", "SCHED_JOB_UMASK"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "agent.toml"
    config.write_text("""
pull_url = "x.json"
state_dir = "st"
job_umask = 0o027
strict_params = false
[actions.b]
argv = ["tar", "-C", "{param:src}", "--", "."]
[actions.b.params.src]
type = "path"
under = ["data", "/srv"]
[actions.c]
argv = ["x"]
strict_params = true
""")
    settings = load_settings(config)
    rule = settings.actions["b"].params["src"]
    assert rule.under == [tmp_path / "data", Path("/srv")]
    assert settings.job_umask == 0o027
    assert settings.actions["b"].strict_params is False  # the agent's setting
    assert settings.actions["c"].strict_params is True  # the action's own
    assert stat.S_IMODE((tmp_path / "st").stat().st_mode) == 0o750


@pytest.mark.parametrize(("text", "value"), [("077", 0o077), ("0o022", 0o022), ("0", 0)])
def test_job_umask_from_the_environment_is_octal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, value: int
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    monkeypatch.setenv("SCHED_JOB_UMASK", text)
    assert load_settings(pull_url="x", state_dir=str(tmp_path / "s")).job_umask == value


@pytest.mark.parametrize("text", ["999", "rw", "0o1000"])
def test_a_bad_umask_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    monkeypatch.setenv("SCHED_JOB_UMASK", text)
    with pytest.raises(ConfigError, match="job_umask"):
        load_settings(pull_url="x", state_dir=str(tmp_path / "s"))


# -- render: the rules every value meets -------------------------------------------


def test_strict_params_refuses_a_row_param_the_action_does_not_declare() -> None:
    spec = _spec("tool", "{param:a}", params={"a": {"type": "int"}})
    assert _render(spec, _row(a=3)) == ["tool", "3"]
    with pytest.raises(ValueRefused, match=(
        r"schedule 's-1' \(backup\): params.extra refused: action 'backup' declares no "
        r"param 'extra' \(strict_params\)")):
        _render(spec, _row(a=3, extra="x"))
    # ActionSpec's default (None) is strict, as the agent's strict_params default is.
    with pytest.raises(ValueRefused, match="declares no param 'b'"):
        _render(_spec("tool", "{param:b}"), _row(b="x"))
    assert _render(_spec("tool", "{param:b}", strict_params=False), _row(b="x")) == ["tool", "x"]
    # A param name is shown escaped: no terminal sequence reaches a log line raw.
    with pytest.raises(ValueRefused) as caught:
        _render(spec, _row(a=3, **{"\x1b[2Jx": 1}))
    assert "params.'\\x1b[2Jx' refused" in str(caught.value)
    assert "\x1b" not in str(caught.value)


# Alike in shape row to row (duplicates lists its runs): a table of a template, a declaration,
# a value and the rule it breaks; each row is another rule.
@pytest.mark.parametrize(
    ("template", "decl", "value", "rule"),
    [
        ("{param:v}", {}, "--help", "starts with '-' at the start of an argv element"),
        ("{param:v}", {}, "-", "starts with '-'"),
        ("{param:e}{param:v}", {}, "-x", "starts with '-'"),  # e is "": v comes first
        ("{param:v}", {}, "", "an argv element may not be empty"),
        ("{param:v}", {}, "(", "may not be one of"),
        ("{param:v}", {}, ";", "may not be one of"),
        ("{param:v}", {}, "a\x00b", "holds a NUL character"),
        ("{param:v}", {}, "a\nb", "holds a newline"),
        ("{param:v}", {}, "a\rb", "holds a carriage return"),
        ("{param:v}", {}, "\x1b[31m", "control character U+001B"),
        ("x={param:v}", {}, "y" * 4097, "4097 bytes long, more than the 4096 allowed"),
        ("x={param:v}", {}, "é" * 2049, "4098 bytes long"),
        ("{state_dir}/a-{param:v}", {}, "../x", "inside a {state_dir} path"),
        ("{state_dir}/a-{param:v}", {}, "x/y", "inside a {state_dir} path"),
        ("{state_dir}/{param:v}", {}, ".", "inside a {state_dir} path"),
        ("{state_dir}/{param:v}", {}, "..", "inside a {state_dir} path"),
        ("{state_dir}/a-{param:v}", {}, "x*", "inside a {state_dir} path"),
        ("a-{param:v}-*.gz", {}, "?", "lands in a pattern"),
        ("a-{param:v}-*.gz", {}, "[ab]", "lands in a pattern"),
        ("--exclude={param:v}", {}, "*.key", "lands in a pattern"),
        ("{param:v}", {"type": "string", "pattern": "[a-z]+"}, "ab1", "does not match"),
        ("{param:v}", {"type": "string", "choices": ["a", "b"]}, "c", "is not one of 'a', 'b'"),
        ("{param:v}", {"type": "string", "max_length": 3}, "abcd", "longer than max_length 3"),
        ("{param:v}", {"type": "string"}, 3, "declared string, it is a int"),
        ("{param:v}", {"type": "int"}, True, "declared int, it is a bool"),
        ("{param:v}", {"type": "int"}, "7", "declared int, it is a str"),
        ("{param:v}", {"type": "int"}, 7.5, "declared int, it is a float"),
        ("{param:v}", {"type": "int", "max": 10}, 11, "above the maximum 10"),
        ("{param:v}", {"type": "int", "min": 1}, 0, "below the minimum 1"),
        ("{param:v}", {"type": "int", "min": 0}, -1, "below the minimum 0"),
        ("{param:v}", {"type": "bool"}, 1, "declared bool, it is a int"),
        ("{param:v}", {"type": "path", "under": ["/srv"]}, "/srv/../etc", "not under /srv"),
        ("{param:v}", {"type": "path", "under": ["/srv"]}, "/srvx", "not under /srv"),
        ("{param:v}", {"type": "path", "under": ["/srv"]}, "srv", "needs the action's cwd"),
        ("{param:v}", {"type": "path", "under": ["/srv"]}, "-x", "may not be empty or start"),
        ("{param:v}", {"type": "path", "under": ["/srv"]}, ["/srv"], "declared path, it is a"),
    ],
)
def test_a_value_that_breaks_a_rule_fails_naming_schedule_field_and_rule(
    template: str, decl: dict[str, Any], value: object, rule: str
) -> None:
    params: dict[str, Any] = {"v": {"type": "string", "max_length": 4096}}
    if decl:
        params["v"] = decl
    params["e"] = {"type": "string", "choices": [""]}
    spec = _spec("tool", template, params=params)
    row = _row(v=value, e="")
    with pytest.raises(ValueRefused) as caught:
        _render(spec, row)
    message = str(caught.value)
    assert message.startswith("schedule 's-1' (backup): params.") and " refused: " in message
    assert rule in message, message


@pytest.mark.parametrize(
    ("field", "value"),
    [("repo_id", "q/../../escaped"), ("repo_id", "*"), ("repo_id", "-x"), ("repo_id", ".hid"),
     ("repo_id", "a b"), ("repo_id", "r" * 201), ("sid", "--help"), ("node", "n;x"),
     ("trigger_key", "--to-command=id")],
)
def test_identifiers_are_checked_wherever_they_land(field: str, value: str) -> None:
    spec = _spec("tool", "--tag={repo_id}", "--id={schedule_id}", "--node={node}",
                 "--trigger={trigger_key}")
    row = _row()
    if field in ("repo_id", "sid"):
        # The row model refuses these too (a pulled row is dropped, the controller
        # answers 422): render_argv must refuse them in a row that got here anyway.
        with pytest.raises(ValueError, match="is not an identifier"):
            _row(**{field: value})
        row = LocalSchedule.model_construct(**{**row.__dict__,
                                               {"sid": "id"}.get(field, field): value})
    label = {"sid": "id", "node": "node (node_name)",
             "trigger_key": "trigger_key (run parameter)"}.get(field, field)
    with pytest.raises(ValueRefused, match="an identifier is letters, digits") as caught:
        _render(spec, row, **({field: value} if field in ("node", "trigger_key") else {}))
    assert f": {label} = " in str(caught.value)


def test_values_that_pass_render_as_data() -> None:
    spec = _spec(
        "tool", "--tag", "{repo_id}", "--repo={storage}", "{param:flag}", "{param:n}",
        "{param:on}", "{state_dir}/archive-{repo_id}-{window}.tar.gz", "--", "{param:text}",
        params={"flag": {"type": "string", "allow_dash": True,
                         "choices": ["--one-file-system", "--exclude-caches"]},
                "n": {"type": "int", "min": 0, "max": 9}, "on": {"type": "bool"},
                "text": {"type": "string", "pattern": "[a-z ]+"}},
    )
    argv = _render(spec, _row(storage="s3:https://h/b x", flag="--exclude-caches", n=4.0,
                              on=False, text="two words"))
    assert argv == ["tool", "--tag", "r-9", "--repo=s3:https://h/b x", "--exclude-caches", "4",
                    "false", "/st/archive-r-9-20261202T0730Z.tar.gz", "--", "two words"]
    with pytest.raises(ValueRefused, match="is not one of"):
        _render(spec, _row(storage="s", flag="--password-command=id", n=1, on=True, text="a"))


def test_a_declared_storage_field_is_held_to_its_roots(tmp_path: Path) -> None:
    spec = _spec("restic", "--repo", "{storage}", fields={"storage": {
        "type": "path", "under": [str(tmp_path / "repos")]}})
    (tmp_path / "repos" / "r-9").mkdir(parents=True)
    assert _render(spec, _row(storage=str(tmp_path / "repos/r-9"))) == [
        "restic", "--repo", str(tmp_path / "repos/r-9")]
    for bad in ("sftp:-oProxyCommand=id:/x", "/tmp/attacker-repo", "--password-command=id"):
        with pytest.raises(ValueRefused, match=r": storage = .* refused"):
            _render(spec, _row(storage=bad))


def test_paths_resolve_symlinks_and_relative_paths_against_cwd(tmp_path: Path) -> None:
    root, outside = tmp_path / "data", tmp_path / "secret"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "link-out").symlink_to(outside)
    (root / "link-in").symlink_to(root / "a")
    spec = _spec("tar", "-C", "{param:p}", "--", ".", cwd=str(tmp_path),
                 params={"p": {"type": "path", "under": [str(root)]}})
    # The command gets the resolved path: what runs is what was checked.
    assert _render(spec, _row(p="data/link-in"))[2] == str(root / "a")
    assert _render(spec, _row(p=str(root / "a/../a")))[2] == str(root / "a")
    assert _render(spec, _row(p=str(root / "not-yet")))[2] == str(root / "not-yet")
    for bad in ("data/link-out", "data/../secret", str(root / "link-out/x"), "/"):
        with pytest.raises(ValueRefused, match=r"is not under .* symlinks are followed"):
            _render(spec, _row(p=bad))


def test_a_symlinked_root_is_compared_by_its_real_path(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "x").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    spec = _spec("tar", "-C", "{param:p}", params={"p": {"type": "path",
                                                         "under": [str(tmp_path / "alias")]}})
    assert _render(spec, _row(p=str(tmp_path / "alias/x"))) == ["tar", "-C", str(real / "x")]


# -- umask and the state folder ----------------------------------------------------


def test_job_processes_run_with_the_job_umask_and_the_agent_keeps_its_own(
    tmp_path: Path,
) -> None:
    script = ("import os, sys; open(sys.argv[1], 'w').write('x'); os.mkdir(sys.argv[2]); "
              "print(oct(os.umask(0)))")
    before = os.umask(0o022)
    try:
        lines: list[str] = []
        result = run_command([sys.executable, "-c", script, str(tmp_path / "f"),
                              str(tmp_path / "d")], timeout_s=30, log=lines.append)
        assert result.exit_code == 0 and lines == ["0o77"]
        assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
        result = run_command([sys.executable, "-c", script, str(tmp_path / "g"),
                              str(tmp_path / "e")], timeout_s=30, umask=0o027)
        assert stat.S_IMODE((tmp_path / "g").stat().st_mode) == 0o640
        assert os.umask(0o022) == 0o022  # the agent's own umask is untouched
    finally:
        os.umask(before)


def test_the_state_folder_is_created_private_and_an_open_one_tightened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    monkeypatch.delenv("SCHED_JOB_UMASK", raising=False)
    fresh = tmp_path / "fresh" / "state"
    load_settings(pull_url="x", state_dir=str(fresh))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    old = tmp_path / "old"
    old.mkdir()
    old.chmod(0o755)
    with caplog.at_level("WARNING", logger="sched_node.settings"):
        load_settings(pull_url="x", state_dir=str(old))
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    assert [r.message for r in caplog.records] == ["state folder tightened"]
    assert caplog.records[0].was == "0o755"  # type: ignore[attr-defined]
    old.chmod(0o711)  # narrower than the umask allows in some bits: only extra bits go
    load_settings(pull_url="x", state_dir=str(old), job_umask="022")
    assert stat.S_IMODE(old.stat().st_mode) == 0o711
