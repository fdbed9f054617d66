"""``GET /api/nodes/{node}/wait``: a node's long poll (:mod:`controller.waits`).

The node sends the ETag of the list it holds (``etag``) and the Prefect counter
of its last answer (``seen``); the answer comes at once when either is out of
date (the counter: this instance saw a newer Prefect event for the node), else
when something for the node happens, else after ``timeout`` seconds (1 to 300,
default 60); a first wait (no ``seen``) is answered at once when the counter is
not 0: ``{"etag": <the list's ETag now>, "prefect": <counter>,
"relay": <whether this instance follows Prefect's events>}``. A node's wait with
its own token is its heartbeat (it is recorded as it pull); an admin may wait
too (to watch a node) and is recorded as nothing.

One wait is held per node and token kind (:mod:`controller.waits`, rule 6): a new one
answers the one it replaces at once with ``409`` (and closes its connection), so one
token cannot hold a connection per request, and two agents sharing a token each back
off (the node backs off after any answer but 200) instead of replacing each other in a
loop. Past a budget of replacements (rule 7) a new wait is refused at once with ``429``
and ``Retry-After``, before anything is read for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from controller.api.jsonbody import check_name
from controller.api.pull import etag_matches
from controller.waits import EtagReads, NodeWaits

MAX_WAIT_S = 300.0
DEFAULT_WAIT_S = 60.0


def wait_router(
    etags: EtagReads,
    require_node: Callable[..., Any],
    waits: NodeWaits,
    seen_by_node: Callable[[str, str], None],
) -> APIRouter:
    """Return the wait route; ``seen_by_node(node, etag)`` records a node's own wait.

    ``etags`` reads the node's ETag, batched with the other waits' reads
    (:class:`controller.waits.EtagReads`): an idle wait costs no session and no
    worker thread of its own.
    """
    router = APIRouter()

    @router.get("/api/nodes/{node}/wait", dependencies=[Depends(require_node)])
    async def wait(
        request: Request, node: str, etag: str = "", seen: str = "",
        timeout: float = Query(DEFAULT_WAIT_S, ge=1, le=MAX_WAIT_S),
    ) -> JSONResponse:
        check_name(("path", "node"), node)
        principal = getattr(request.state, "principal", None)
        holder = principal.label if principal is not None else "-"
        retry = waits.refused_s(node, holder)
        if retry:
            return JSONResponse(
                {"detail": f"node {node!r} replaced its wait too often (one wait per node: is "
                 f"a second agent using its token?): try again in {retry} s"},
                status_code=429, headers={"Retry-After": str(retry), "Connection": "close",
                                          "Cache-Control": "no-store"})
        now = await etags.etag(node)
        stale = bool(etag) and not etag_matches(etag, now)
        if principal is not None and not principal.is_admin and not stale:
            seen_by_node(node, now)  # a stale node pulls next, and that pull is recorded
        # A node's first wait (no ``seen``: it just started) is answered at once when this
        # process poked the node since it started, so a run made while the node was away is
        # looked for now (sched_node.control, "At the node's start"); else it is held.
        changed = stale or (waits.newer(node, seen) if seen else waits.poked(node))
        if not changed:
            if await waits.wait(node, timeout, holder=holder) == "replaced":
                return JSONResponse(
                    {"detail": f"this wait of node {node!r} was replaced by a newer one with "
                     "the same token (one wait per node: is a second agent using it?)"},
                    status_code=409, headers={"Cache-Control": "no-store", "Connection": "close"})
            now = await etags.etag(node)
        return JSONResponse({"etag": now, "prefect": waits.token(node), "relay": waits.relay},
                            headers={"Cache-Control": "no-store"})

    return router
