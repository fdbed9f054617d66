"""Serve the agent's three deployments from one process: the embedded default.

The same deployments as ``prefect.yaml`` (names, schedules, trigger,
concurrency limits), registered and run by ``prefect.serve`` against the
server in ``PREFECT_API_URL``; no work pool or worker needed. Each flow run
executes in a subprocess of this one. Needs a real server: in ephemeral mode
Prefect never creates scheduled runs.

    SCHED_CONFIG=examples/agent.toml PREFECT_API_URL=http://127.0.0.1:4200/api \\
        python -m deployments.serve
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any
from uuid import UUID

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.exceptions import TerminationSignal
from prefect.schedules import Interval

from flows.automations import HEARTBEAT_S, ensure_automations
from flows.chain import advance_chain
from flows.job import run_job
from flows.pull_listener import PullListener
from flows.reconcile import reconcile
from flows.runtime import (
    EVENT_JOB_COMPLETED,
    EVENT_JOB_FAILED,
    EVENT_SCHEDULES_UPDATED,
    keep_runless_logs_local,
)
from flows.settings import AgentSettings, load_settings
from sched_core import SchedError

ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)


def chain_trigger(node: str) -> DeploymentEventTrigger:
    """Return the trigger that runs advance-chain on each of node's job events."""
    return DeploymentEventTrigger(
        enabled=True,
        match={"prefect.resource.id": f"sched.agent.{node}"},
        expect={EVENT_JOB_COMPLETED, EVENT_JOB_FAILED},
        parameters={
            "action": "{{ event.payload.action }}",
            "node": "{{ event.payload.node }}",
            "completed_run": "{{ event.payload.flow_run_id }}",
        },
    )


def pull_trigger(node: str) -> DeploymentEventTrigger:
    """Return the trigger that runs reconcile when the controller changed node's schedules."""
    return DeploymentEventTrigger(
        enabled=True,
        match={"prefect.resource.id": f"sched.agent.{node}"},
        expect={EVENT_SCHEDULES_UPDATED},
    )


def build_deployments(settings: AgentSettings) -> list[RunnerDeployment]:
    """Return reconcile, run-job and advance-chain, named after the node."""
    node = settings.node_name
    tags = ["sched-agent"]
    built: list[object] = [
        reconcile.to_deployment(
            name=node,
            schedules=[Interval(settings.reconcile_interval)],
            triggers=[pull_trigger(node)],
            # One at a time, queued: a change the controller announces while a
            # reconcile runs must still be pulled after it.
            concurrency_limit=ONE_AT_A_TIME,
            tags=tags,
            description="Pull the schedule list and plan the coming windows' run-job runs.",
        ),
        run_job.to_deployment(
            name=node,
            # The node's job slots: a limit on run-job only, so eight long
            # backups never keep a reconcile or the chain from starting.
            concurrency_limit=ConcurrencyLimitConfig(
                limit=settings.job_limit, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE
            ),
            tags=tags,
            description="Run one action of one schedule and window (planned ahead by reconcile).",
        ),
        advance_chain.to_deployment(
            name=node,
            triggers=[chain_trigger(node)],
            concurrency_limit=ONE_AT_A_TIME,
            tags=tags,
            description="Feed a job completion to the chain: prune after the wave, then check.",
        ),
    ]
    # to_deployment dispatches sync or async by context; here it is always sync.
    assert all(isinstance(item, RunnerDeployment) for item in built)
    return [item for item in built if isinstance(item, RunnerDeployment)]


RUNNER_POLL_S = 10
"""Seconds between the serve process's polls for runs to start (PREFECT_RUNNER_POLL_FREQUENCY).

Prefect's default. Polling every 2 s brought a triggered reconcile (a change the
controller announced) a few seconds sooner, but an idle node's polls are most of
what it costs the Prefect server (bench/bench_idle.py): every 2 s that is about
23 s of server CPU an hour per node, more than the per-minute tick this design
replaced. A fleet that wants it can set ``PREFECT_RUNNER_POLL_FREQUENCY``."""
BACKOFF_MIN_S = 5.0
BACKOFF_MAX_S = 60.0
HEALTHY_AFTER_S = 120.0
"""A serve that ran this long before failing starts the backoff over."""

log = logging.getLogger("deployments.serve")


def main() -> int:
    """Load the settings, then serve until stopped (SIGTERM or SIGINT), whatever else happens.

    A thread follows the node's ``sched.schedules.updated`` events and pulls
    each change at once (:mod:`flows.pull_listener`).

    The node's one long-running process survives an outage of the Prefect
    server: ``serve`` gives up after about four minutes without it (or cannot
    register its deployments while it is down); it is then started again in
    this process, with a capped backoff (5 s doubling to 60 s), until the
    server answers. Windows that came due meanwhile go through the start guard.
    """
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "sched_core,flows")
    # Heartbeats every 30 s from each flow run's process: the agent's automations
    # crash runs whose process is gone (flows/automations.py).
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
    keep_runless_logs_local()  # this process's own lines (not its runs') stay on the console
    try:
        settings = load_settings()
    except SchedError as exc:
        print(f"sched-agent: {exc}", file=sys.stderr)
        return 2
    listener: PullListener | None = None
    backoff = BACKOFF_MIN_S
    attempt = 0
    while True:
        attempt += 1
        signal.signal(signal.SIGTERM, _exit_between_serves)
        started = time.monotonic()
        try:
            deployments = build_deployments(settings)
            prepare(deployments)
            if listener is None:  # once, after the first prepare: logging is set up by then
                listener = listen(settings)
            # No runner-wide limit: it would be one pool of slots for all three
            # deployments, and long jobs holding them would keep reconcile from
            # planning. Jobs are limited by run-job's own limit (job_limit).
            serve(*deployments, limit=None, print_starting_message=attempt == 1,
                  query_seconds=poll_seconds())
            return 0  # serve returns only when it was stopped (SIGTERM, SIGINT)
        except (KeyboardInterrupt, SystemExit, TerminationSignal):
            # TerminationSignal: a SIGTERM while the reconcile at start ran (a
            # flow run in this process installs Prefect's own SIGTERM handler).
            _stopping()
            return 0
        except Exception as exc:
            if _stop_asked.is_set():
                return 0  # a stop was asked; what failed was the way out
            log.error(
                "serving stopped after %.0f s (%s: %s); starting again in %.0f s",
                time.monotonic() - started, type(exc).__name__, exc,
                backoff if time.monotonic() - started <= HEALTHY_AFTER_S else BACKOFF_MIN_S,
                extra={"node": settings.node_name, "attempt": attempt, "error": repr(exc)},
            )
        if time.monotonic() - started > HEALTHY_AFTER_S:
            backoff = BACKOFF_MIN_S
        signal.signal(signal.SIGTERM, _exit_between_serves)
        time.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


def serve(
    *deployments: RunnerDeployment,
    limit: int | None,
    print_starting_message: bool,
    query_seconds: float | None,
) -> None:
    """Run Prefect's runner over the deployments until stopped: ``prefect.serve``, with two changes.

    1. The deployments are not paused on the way out (``pause_on_shutdown=False``):
       the node's planned runs stay as they are while it is down (the next start
       applies the deployments again), and a stop during a Prefect outage does
       not wait on a server that is gone.
    2. A failure after a stop was asked (SIGTERM, SIGINT) is a stop, not a
       failure: the supervisor loop in :func:`main` must not start serving again
       because the way out could not reach the server.
    """
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=False, limit=limit, query_seconds=query_seconds)
    prefect_sigterm = runner.handle_sigterm

    def on_sigterm(*args: Any, **kwargs: Any) -> None:
        _stopping()
        prefect_sigterm(*args, **kwargs)

    runner.handle_sigterm = on_sigterm  # type: ignore[method-assign]  # start() installs it
    for deployment in deployments:
        runner.add_deployment(deployment)
    if print_starting_message:
        names = ", ".join(f"{item.flow_name}/{item.name}" for item in deployments)
        print(f"sched-agent: serving {names}; polling for runs every "
              f"{runner.query_seconds:g} s (stop with Ctrl-C or SIGTERM)", flush=True)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        return
    except Exception as exc:
        if not runner.stopping and not _stop_asked.is_set():
            raise
        log.warning("stopped; the way out failed (%s: %s): runs this process had may be "
                    "left Running until the agent's automations mark them Crashed",
                    type(exc).__name__, exc, extra={"error": repr(exc)[:300]})


def listen(settings: AgentSettings) -> PullListener:
    """Start the listener that pulls each change the controller announces, unless turned off.

    The triggered reconcile run then plans the change (flows/pull_listener.py).
    """
    listener = PullListener(settings)
    if settings.listen:
        return listener.start()
    log.info("not listening for the controller's changes (listen = false): they arrive with "
             "the reconcile runs their events trigger", extra={"node": settings.node_name})
    return listener


def poll_seconds() -> float | None:
    """Return how often serve polls for runs to start: every 10 s unless the environment says.

    The runs a trigger creates (the controller's ``sched.schedules.updated``: pull
    now) start at the serve process's next poll (bench/bench_propagation.py).
    None: the operator's ``PREFECT_RUNNER_POLL_FREQUENCY``, which the runner reads.
    """
    return None if os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY") else float(RUNNER_POLL_S)


STOP_GRACE_S = 30.0
"""The longest the process lives on once a stop was asked (then it exits, code 0)."""
_stop_asked = threading.Event()


def _stopping() -> None:
    """Note that a stop was asked, and make sure the process ends within STOP_GRACE_S.

    Prefect's way out (the runner's, or a flow's in this process) may wait on
    a server that is gone, with retries; a node told to stop must stop, as
    systemd would make it after its own timeout. Runs still in flight are
    then ended by the agent's automations (Crashed), then re-run once.
    """
    if _stop_asked.is_set():
        return
    _stop_asked.set()

    def deadline() -> None:
        time.sleep(STOP_GRACE_S)
        log.error("still running %.0f s after the stop was asked: exiting now", STOP_GRACE_S)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)

    threading.Thread(target=deadline, name="stop-deadline", daemon=True).start()


def _exit_between_serves(signum: int, frame: FrameType | None) -> None:
    """Stop at once when told to between two serves (serve installs its own handlers)."""
    _stopping()
    raise SystemExit(0)


def prepare(deployments: list[RunnerDeployment]) -> None:
    """Register the deployments, ensure the agent's automations, and reconcile now.

    The reconcile plans the node's windows, ends the late runs its start guard
    would skip, and runs its interrupted jobs again: without it a fresh or
    restarted node would wait for the first interval run of reconcile (up to
    ``reconcile_interval``). It runs here, in this process, before serving, so
    that a node back from downtime does not first start a process for each late
    run only to skip it. When it fails (no controller, a busy server) serving
    starts anyway, with a reconcile run asked of the deployment.
    """
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    ids = {item.flow_name: item.apply() for item in deployments}
    reconcile_id = ids["reconcile"]
    assert isinstance(reconcile_id, UUID)  # apply is sync here
    with get_client(sync_client=True) as client:
        ensure_automations(client)
    try:
        reconcile()
    except Exception as exc:
        log.warning("the reconcile at start failed (%s: %s); serving, and asking for another",
                    type(exc).__name__, exc, extra={"error": repr(exc)})
        with get_client(sync_client=True) as client:
            client.create_flow_run_from_deployment(reconcile_id, state=Scheduled())


if __name__ == "__main__":
    sys.exit(main())
