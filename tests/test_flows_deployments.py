"""prefect.yaml and deployments/serve.py describe the same three deployments (no server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent


def _yaml() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return data


def test_prefect_yaml_deploys_the_three_flows_per_node() -> None:
    deployments = {d["entrypoint"]: d for d in _yaml()["deployments"]}
    assert set(deployments) == {
        "flows/reconcile.py:reconcile", "flows/job.py:run_job", "flows/chain.py:advance_chain",
    }
    for item in deployments.values():
        assert item["name"] == "{{ $SCHED_NODE_NAME }}"
        assert item["work_pool"]["name"] == "sched-agent"
        assert item["work_pool"]["work_queue_name"] == "{{ $SCHED_NODE_NAME }}"
        env = item["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "sched_core,flows"
    reconcile = deployments["flows/reconcile.py:reconcile"]
    assert reconcile["schedules"] == [{"interval": 900}]  # the default reconcile_interval
    assert reconcile["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    pull, = reconcile["triggers"]
    assert pull["expect"] == ["sched.schedules.updated"]
    assert pull["match"] == {"prefect.resource.id": "sched.agent.{{ $SCHED_NODE_NAME }}"}
    job = deployments["flows/job.py:run_job"]
    assert job["schedules"] == []
    assert job["concurrency_limit"] == {"limit": 8, "collision_strategy": "ENQUEUE"}
    chain = deployments["flows/chain.py:advance_chain"]
    trigger, = chain["triggers"]
    assert set(trigger["expect"]) == {"sched.job.completed", "sched.job.failed"}
    assert trigger["match"] == {"prefect.resource.id": "sched.agent.{{ $SCHED_NODE_NAME }}"}
    assert trigger["parameters"]["action"] == "{{ event.payload.action }}"
    assert chain["concurrency_limit"]["limit"] == 1


def test_serve_builds_the_same_deployments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deployments.serve import build_deployments

    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = load_settings(pull_url="schedules.json", node_name="node-a", state_dir=tmp_path)
    built = {d.flow_name: d for d in build_deployments(settings)}
    assert set(built) == {"reconcile", "run-job", "advance-chain"}
    assert {d.name for d in built.values()} == {"node-a"}
    interval = built["reconcile"].schedules[0].schedule
    assert getattr(interval, "interval", None).total_seconds() == 900
    pull, = built["reconcile"].triggers
    assert pull.match.root == {"prefect.resource.id": "sched.agent.node-a"}
    assert pull.expect == {"sched.schedules.updated"}
    assert built["run-job"].schedules in (None, [])
    trigger, = built["advance-chain"].triggers
    assert trigger.match.root == {"prefect.resource.id": "sched.agent.node-a"}
    assert trigger.expect == {"sched.job.completed", "sched.job.failed"}
    for name in ("reconcile", "advance-chain"):
        limit = built[name].concurrency_limit
        assert getattr(limit, "limit", limit) == 1


def test_only_jobs_are_limited_so_long_jobs_never_hold_back_reconcile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run-job has the node's job slots; serve itself runs with no runner-wide limit."""
    import deployments.serve as serve_module

    monkeypatch.delenv("SCHED_CONFIG", raising=False)
    settings = load_settings(pull_url="schedules.json", node_name="node-a", state_dir=tmp_path)
    assert settings.job_limit == 8
    jobs = {d.flow_name: d for d in serve_module.build_deployments(settings)}["run-job"]
    assert jobs.concurrency_limit == 8
    assert jobs.concurrency_options is not None
    assert jobs.concurrency_options.collision_strategy == "ENQUEUE"

    monkeypatch.setenv("SCHED_JOB_LIMIT", "3")
    monkeypatch.setenv("SCHED_PULL_URL", "schedules.json")
    monkeypatch.setenv("SCHED_NODE_NAME", "node-a")
    monkeypatch.setenv("SCHED_STATE_DIR", str(tmp_path))
    served: dict[str, Any] = {}

    def fake_serve(*deployments: Any, **options: Any) -> None:
        served["deployments"] = {d.flow_name: d for d in deployments}
        served["options"] = options

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.setattr(serve_module, "prepare", lambda deployments: None)
    monkeypatch.setenv("SCHED_LISTEN", "0")  # no event stream here (tests/test_pull_listener.py)
    monkeypatch.delenv("PREFECT_RUNNER_POLL_FREQUENCY", raising=False)
    assert serve_module.main() == 0
    # The runner polls every 10 s, Prefect's default (see RUNNER_POLL_S for why not faster).
    assert served["options"] == {"limit": None, "print_starting_message": True,
                                 "query_seconds": 10.0}
    limited = {name: d.concurrency_limit for name, d in served["deployments"].items()}
    assert limited == {"reconcile": 1, "run-job": 3, "advance-chain": 1}
    # An operator's PREFECT_RUNNER_POLL_FREQUENCY wins (the runner reads it itself).
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "10")
    assert serve_module.main() == 0
    assert served["options"]["query_seconds"] is None


def test_a_stop_that_prefect_cannot_finish_still_ends_the_process_with_code_0() -> None:
    """serve's stop deadline: once a stop is asked, the process ends within STOP_GRACE_S,
    whatever Prefect's way out is waiting on (a server that is gone, say)."""
    import subprocess
    import sys

    code = ("import time, deployments.serve as s; s.STOP_GRACE_S = 0.5; s._stopping(); "
            "time.sleep(60); print('not stopped')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert "not stopped" not in done.stdout
    assert "exiting now" in done.stderr
