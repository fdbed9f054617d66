"""What the operator's commands ask Prefect: an ad hoc job run, a schedule's recent runs, the UI.

Prefect is the one named by ``PREFECT_API_URL`` (environment or profile). Without
one the commands refuse (exit 2) instead of letting Prefect's client start a
temporary server of its own, where a run would vanish with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from sched_ops.client import Exit, OpsError, shown_url

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

T = TypeVar("T")

RUN_JOB = "run-job"
"""The agent's job flow; each node's deployment of it is ``run-job/<node>``."""


def api_url() -> str:
    """Return the configured Prefect API URL; USAGE when none is set."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise OpsError("no Prefect API: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)",
                       Exit.USAGE)
    return str(url)


def ui_url() -> str:
    """Return the Prefect UI's base URL: ``PREFECT_UI_URL``, else the API's without ``/api``."""
    from prefect.settings import PREFECT_UI_URL

    configured = PREFECT_UI_URL.value()
    if configured:
        return str(configured).rstrip("/")
    api = api_url().rstrip("/")
    return api[: -len("/api")] if api.endswith("/api") else api


def run_url(flow_run_id: object) -> str:
    """Return the Prefect UI page of a flow run."""
    return f"{ui_url()}/runs/flow-run/{flow_run_id}"


def with_client(work: Callable[[SyncPrefectClient], T]) -> T:
    """Run work with a Prefect client; unreachable Prefect is UNREACHABLE, naming the URL."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    url = api_url()
    try:
        with get_client(sync_client=True) as client:
            return work(client)
    except ObjectNotFound as exc:
        raise OpsError(f"not found on the Prefect API at {shown_url(url)}: {exc}",
                       Exit.REFUSED) from None
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        raise OpsError(
            f"the Prefect API at {shown_url(url)} answered {status} to "
            f"{exc.request.method} {exc.request.url.path}: {exc.response.text[:300]}",
            Exit.REFUSED if status < 500 else Exit.BAD_ANSWER) from None
    except httpx.HTTPError as exc:
        raise OpsError(f"cannot reach the Prefect API at {shown_url(url)} "
                       f"({type(exc).__name__}: {exc})", Exit.UNREACHABLE) from None


def run_job(node: str, schedule_id: str, *, action: str | None = None,
            voucher: str | None = None) -> dict[str, Any]:
    """Create an ad hoc run of ``run-job/<node>`` with ``{"schedule_id": ...}``; return it.

    With the action known (from the controller), the run carries the tags a
    planned run of it carries (``node:``, ``action:``, ``schedule:``,
    ``trigger:manual``), so its job event counts for the wave's alert at once. With a
    voucher (from the controller), the run carries it, when the node's deployment takes
    one (a node with ``ad_hoc_runs = "controller"`` needs it).
    """
    from prefect.exceptions import ObjectNotFound

    deployment_name = f"{RUN_JOB}/{node}"

    def create(client: SyncPrefectClient) -> dict[str, Any]:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound:
            raise OpsError(
                f"no deployment {deployment_name!r} on the Prefect API at "
                f"{shown_url(api_url())}: is the node's agent deployed or served?",
                Exit.REFUSED) from None
        tags = set(deployment.tags or [])
        if action:
            tags |= {f"node:{node}", f"action:{action}", f"schedule:{schedule_id}",
                     "trigger:manual"}
        parameters: dict[str, Any] = {"schedule_id": schedule_id}
        takes = (deployment.parameter_openapi_schema or {}).get("properties") or {}
        if voucher and "voucher" in takes:
            parameters["voucher"] = voucher
        run = client.create_flow_run_from_deployment(
            deployment.id, parameters=parameters, tags=sorted(tags))
        return {"id": str(run.id), "name": run.name, "deployment": deployment_name,
                "state": run.state.name if run.state else "", "url": run_url(run.id)}

    return with_client(create)


def recent_runs(node: str, schedule_id: str, *, limit: int = 10) -> list[dict[str, Any]] | None:
    """Return a schedule's latest runs on node that are not merely Scheduled (newest first).

    None when no Prefect API is configured: ``describe`` then shows the node's report only.
    """
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return None
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    def read(client: SyncPrefectClient) -> list[dict[str, Any]]:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"node:{node}", f"schedule:{schedule_id}"]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(
                    not_any_=[StateType.SCHEDULED])),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=limit,
        )
        return [{
            "id": str(run.id), "name": run.name,
            "state": run.state.name if run.state else "",
            "start": run.start_time.isoformat() if run.start_time else None,
            "end": run.end_time.isoformat() if run.end_time else None,
            "url": run_url(run.id),
        } for run in runs]

    return with_client(read)


def cancel_run(flow_run_id: str, *, voucher: str | None = None) -> dict[str, Any]:
    """Ask Prefect to cancel a flow run (Cancelling, as the UI's Cancel does), with the
    controller's voucher in the state's message when there is one; return the run."""
    import uuid

    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelling

    try:
        run_id = uuid.UUID(flow_run_id)
    except ValueError:
        raise OpsError(f"{flow_run_id!r} is not a flow run id", Exit.REFUSED) from None

    def cancel(client: SyncPrefectClient) -> dict[str, Any]:
        try:
            run = client.read_flow_run(run_id)
        except ObjectNotFound:
            raise OpsError(f"no flow run {flow_run_id} on the Prefect API at "
                           f"{shown_url(api_url())}", Exit.REFUSED) from None
        message = "cancelled with sched cancel" + (f"; voucher={voucher}" if voucher else "")
        status = client.set_flow_run_state(run_id, Cancelling(message=message)).status
        return {"id": flow_run_id, "name": run.name, "status": str(status.value),
                "state": run.state.name if run.state else "", "url": run_url(run_id)}

    return with_client(cancel)
