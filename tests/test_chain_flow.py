"""advance-chain fed by an event that names no action (an ad hoc run-job by schedule id).

Found by hand on two nodes: ``prefect deployment run 'run-job/node-a' --params
'{"schedule_id": "a-backup"}'`` completes, but its ``sched.job.completed`` event
carries an empty ``action``, so the chain took it for no wave job. advance-chain
now reads the action from the completed run's ``action:`` tag, and run-job names
such a run and fills its event from the cached row.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_prefect import agent_events

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]


def _row(sid: str, action: str, shape: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": sid, "name": f"{action} {sid}", "repo_id": "r-1", "action": action,
        "schedule": shape, "miss_policy": "skip", "enabled": True, "version": 1,
    }


def _job_events(node: str, run_id: str) -> list[dict[str, Any]]:
    """Return the sched.job.completed events of run_id (waiting up to 15 s for one)."""
    events = agent_events("sched.job.completed", node,
                          lambda found: any(_of(e, run_id) for e in found))
    return [e for e in events if _of(e, run_id)]


def _of(event: dict[str, Any], run_id: str) -> bool:
    return bool(event["payload"].get("flow_run_id") == run_id)


def _node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]],
          tables: str = "") -> str:
    """Set up a node (its schedules file, agent.toml and environment); return its name."""
    node = f"n-{uuid.uuid4().hex[:8]}"
    (tmp_path / "schedules.json").write_text(json.dumps({"schedules": rows}))
    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "{node}"\npull_url = "schedules.json"\nstate_dir = "state"\n{tables}')
    monkeypatch.setenv("SCHED_CONFIG", str(config))
    for name in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    return node


def test_completed_action_reads_the_run_tag() -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows.chain import completed_action

    @flow(name="chain-tag-probe")
    def probe() -> None: ...

    with get_client(sync_client=True) as client:
        tagged = client.create_flow_run(probe, tags=["node:x", "action:backup"])
        untagged = client.create_flow_run(probe, tags=["node:x"])
    assert completed_action(str(tagged.id)) == "backup"
    assert completed_action(str(untagged.id)) == ""
    assert completed_action(str(uuid.uuid4())) == ""
    assert completed_action("not-a-uuid") == ""


def test_ad_hoc_backup_by_schedule_id_starts_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.chain import advance_chain
    from flows.job import run_job
    from flows.reconcile import reconcile

    py = json.dumps(sys.executable)
    node = _node(tmp_path, monkeypatch, [
        _row("b-1", "backup", {"on": "manual"}),
        _row("p-1", "prune", {"on": "after_wave"}),
    ], f'[actions.backup]\nargv = [{py}, "-c", "print(1)"]\n'
       f'[actions.prune]\nargv = [{py}, "-c", "print(2)"]\n'
       '[[stages]]\nname = "prune"\naction = "prune"\n')
    run_job.to_deployment(name=node).apply()  # the chain's stage fires land here

    assert reconcile()["schedules"] == 2
    state = run_job(schedule_id="b-1", return_state=True)
    assert state.is_completed(), state.message
    backup_id = str(state.state_details.flow_run_id)

    # The run is named after the cached row's action, and its event names the action.
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(backup_id).name.startswith("backup-b-1-")
    [completed] = _job_events(node, backup_id)
    assert (completed["payload"]["action"], completed["payload"]["schedule_id"]) == (
        "backup", "b-1")

    # The event of such a run names no action: the chain finds it on the run.
    assert advance_chain(action="", node=node, completed_run=backup_id) == ["prune"]
    marks = json.loads((tmp_path / "state" / "chain.json").read_text())["stages"]
    assert marks["prune"]["fired"] == ["p-1"]


def test_reconcile_runs_again_an_advance_chain_run_the_node_stop_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the e2e test: the node was killed while the backup's advance-chain run was
    Pending; the automation crashed it and the day's prune never came. The reconcile now
    runs such a run again once, with the same parameters; an operator's cancel stays."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling, Crashed, Pending

    from flows.chain import advance_chain
    from flows.job import run_job
    from flows.reconcile import reconcile

    node = _node(tmp_path, monkeypatch, [])
    run_job.to_deployment(name=node).apply()
    chain_id = advance_chain.to_deployment(name=node).apply()
    params = {"action": "backup", "node": node, "completed_run": str(uuid.uuid4())}
    with get_client(sync_client=True) as client:
        killed = client.create_flow_run_from_deployment(chain_id, parameters=params)
        client.set_flow_run_state(killed.id, Pending(), force=True)
        client.set_flow_run_state(
            killed.id, Crashed(message="Flow run marked as crashed by the sched-agent "
                                       "automation: still Pending after 120 s"), force=True)
        cancelled = client.create_flow_run_from_deployment(
            chain_id, parameters={**params, "action": "prune"})
        client.set_flow_run_state(cancelled.id, Pending(), force=True)
        client.set_flow_run_state(cancelled.id, Cancelling(), force=True)
        client.set_flow_run_state(cancelled.id, Cancelled(), force=True)

        assert reconcile()["chains_resumed"] == 1
        reruns = _reruns(client, chain_id)
        assert len(reruns) == 1, [(run.name, run.tags) for run in reruns]
        assert reruns[0].parameters == params
        assert reruns[0].state is not None and reruns[0].state.type.value == "SCHEDULED"
        # Handled once: the next reconcile does not run it a third time.
        assert reconcile()["chains_resumed"] == 0
        again = _reruns(client, chain_id)
        assert [run.id for run in again] == [reruns[0].id]


def test_reconcile_runs_again_a_chain_stage_job_the_node_stop_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the clean-clone CI run of the e2e test: the node was killed while the
    chain's prune ran; it ended Crashed and the day's prune never ran. The reconcile now
    runs a chain stage's interrupted job once more, under ``<key>:retry``; the re-run
    runs the cached row. A stage job an operator cancelled stays cancelled, and a row
    that left the stage is not re-run (the artifact says why)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling, Crashed, Running

    from flows.dispatch import JobRef, Planned, runs_of
    from flows.job import run_job
    from flows.reconcile import reconcile

    py = json.dumps(sys.executable)
    out = tmp_path / "pruned.txt"
    schedules = tmp_path / "schedules.json"
    node = _node(tmp_path, monkeypatch, [
        _row(sid, "prune", {"on": "after_wave"}) for sid in ("p-1", "p-2", "p-3")
    ], f'[actions.prune]\nargv = [{py}, "-c", "import sys; open(sys.argv[1], \'a\')'
       f'.write(sys.argv[2] + chr(10))", {json.dumps(str(out))}, "{{schedule_id}}"]\n'
       '[[stages]]\nname = "prune"\naction = "prune"\n')
    deployment_id = run_job.to_deployment(name=node).apply()
    assert reconcile()["schedules"] == 3

    # The chain fired the day's prune of three rows (as ChainDispatcher does).
    refs = {sid: JobRef(node=node, action="prune", schedule_id=sid, trigger_key="chain-prune",
                        window=None, key=f"{sid}@prune@2026-12-03") for sid in ("p-1", "p-2",
                                                                               "p-3")}
    with runs_of(node) as runs:
        created = runs.create([Planned(ref=ref, start=ref_start()) for ref in refs.values()])
    ids = {sid: created.runs[ref.idempotency_key] for sid, ref in refs.items()}
    with get_client(sync_client=True) as client:
        for run_id in ids.values():
            client.set_flow_run_state(run_id, Running(), force=True)
        # p-1 and p-3: killed with the node; p-2: an operator cancelled it.
        for sid in ("p-1", "p-3"):
            client.set_flow_run_state(
                ids[sid], Crashed(message="Process exited with status code -9"), force=True)
        client.set_flow_run_state(ids["p-2"], Cancelling(), force=True)
        client.set_flow_run_state(ids["p-2"], Cancelled(), force=True)
    # p-3 leaves the stage before the node is back: it now runs by hand only.
    rows = json.loads(schedules.read_text())["schedules"]
    rows[2]["schedule"] = {"on": "manual"}
    rows[2]["version"] = 2
    schedules.write_text(json.dumps({"schedules": rows}))

    counts = reconcile()
    assert counts["retried"] == 1, counts
    with get_client(sync_client=True) as client:
        reruns = _reruns(client, deployment_id)
        assert [run.name for run in reruns] == [f"{refs['p-1'].name}-retry"]
        rerun = reruns[0]
        assert rerun.parameters["retry_of"] == ids["p-1"]
        assert rerun.parameters["key"] == "p-1@prune@2026-12-03"
        assert rerun.parameters["trigger_key"] == "chain-prune"
        assert rerun.parameters["window"] is None
        assert "trigger:chain-prune" in rerun.tags
        artifact = _latest_markdown(client, f"reconcile-{node}")
        assert "is no longer a 'after_wave' prune schedule of the chain stage prune" in artifact
        # Handled once: the next reconcile creates nothing more.
        assert reconcile()["retried"] == 0
        assert [run.id for run in _reruns(client, deployment_id)] == [rerun.id]

    # The re-run runs the cached row once (started as a worker would: its parameters).
    state = run_job(**rerun.parameters, return_state=True)
    assert state.is_completed() and state.name == "Completed", (state.name, state.message)
    assert out.read_text().splitlines() == ["p-1"]

    # Were the killed run alive after all (it completed), its re-run would not run; it
    # then feeds the chain itself (it sends no job event, and while it waited the chain
    # held the next stage back for it).
    from flows.chain import advance_chain

    chain_id = advance_chain.to_deployment(name=node).apply()
    with get_client(sync_client=True) as client:
        from prefect.states import Completed
        client.set_flow_run_state(ids["p-1"], Completed(), force=True)
    state = run_job(**rerun.parameters, return_state=True)
    assert state.name == "Skipped", (state.name, state.message)
    assert "is Completed now, not interrupted" in (state.message or "")
    assert out.read_text().splitlines() == ["p-1"]
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

        fed = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[chain_id])))
    assert [run.parameters for run in fed] == [{
        "action": "prune", "node": node,
        "completed_run": str(state.state_details.flow_run_id)}]


def ref_start() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def _latest_markdown(client: Any, key: str) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    [artifact] = client.read_latest_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1)
    return str(artifact.data)


def _reruns(client: Any, deployment_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterTags,
    )

    return list(client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
        tags=FlowRunFilterTags(all_=["retry"]))))
