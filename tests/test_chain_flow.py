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

    node = f"n-{uuid.uuid4().hex[:8]}"
    py = json.dumps(sys.executable)
    (tmp_path / "schedules.json").write_text(json.dumps({"schedules": [
        _row("b-1", "backup", {"on": "manual"}),
        _row("p-1", "prune", {"on": "after_wave"}),
    ]}))
    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "{node}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
        f'[actions.backup]\nargv = [{py}, "-c", "print(1)"]\n'
        f'[actions.prune]\nargv = [{py}, "-c", "print(2)"]\n'
        '[[stages]]\nname = "prune"\naction = "prune"\n'
    )
    monkeypatch.setenv("SCHED_CONFIG", str(config))
    for name in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
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

    node = f"n-{uuid.uuid4().hex[:8]}"
    (tmp_path / "schedules.json").write_text(json.dumps({"schedules": []}))
    config = tmp_path / "agent.toml"
    config.write_text(f'node_name = "{node}"\npull_url = "schedules.json"\nstate_dir = "state"\n')
    monkeypatch.setenv("SCHED_CONFIG", str(config))
    for name in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
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


def _reruns(client: Any, deployment_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterTags,
    )

    return list(client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
        tags=FlowRunFilterTags(all_=["retry"]))))
