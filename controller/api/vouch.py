"""Vouchers: the controller's word that an ad hoc run or a cancel on a node is wanted.

``POST /api/nodes/{node}/vouchers`` (admin) with ``{"purpose": "run" | "chain" |
"cancel", "subject": ...}`` (the schedule id, the node, the flow run id) answers
``{"voucher": ..., "expires_at": ...}``: a voucher (:mod:`sched_core.vouchers`) signed
with the node's tokens, good for one use within :data:`VOUCHER_TTL`. ``sched run`` and
``sched cancel`` ask for one; a node with ``ad_hoc_runs = "controller"`` takes a run or a
cancel only with it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from controller.api.access import Auth
from controller.api.jsonbody import check_name, check_node, read_object
from controller.api.openapi import json_body
from controller.errors import InvalidInput
from controller.logtext import printable
from sched_core.values import format_go_time
from sched_core.vouchers import PURPOSES, issue

log = logging.getLogger("controller.api")

VOUCHER_TTL = timedelta(hours=1)
"""How long a voucher is good for: a node that is away longer refuses the run, saying so."""


class VoucherRequest(BaseModel):
    """The body of a voucher request; documents the route (the route reads the body itself)."""

    purpose: Literal["run", "chain", "cancel"] = Field(
        description="what the voucher allows: a run, a chain or a cancel")
    subject: str = Field(description="the schedule id (run), the node (chain) or the flow "
                                     "run id (cancel)")


def voucher_router(auth: Auth, clock: Callable[[], datetime]) -> APIRouter:
    """Return the voucher route."""
    router = APIRouter()

    @router.post("/api/nodes/{node}/vouchers", dependencies=[Depends(auth.admin)],
                 openapi_extra=json_body(VoucherRequest, "What the voucher is for."))
    async def vouch(request: Request, node: str) -> JSONResponse:
        check_node(("path", "node"), node)
        body = await read_object(request, "node", node)
        purpose, subject = body.get("purpose"), body.get("subject")
        if purpose not in PURPOSES:
            raise InvalidInput([{"field": "purpose", "loc": ["body", "purpose"],
                                 "type": "value_error",
                                 "msg": f"purpose is one of {', '.join(sorted(PURPOSES))}"}])
        if not isinstance(subject, str):
            raise InvalidInput([{"field": "subject", "loc": ["body", "subject"],
                                 "type": "value_error", "msg": "subject: a schedule id, the "
                                 "node or a flow run id"}])
        check_name(("body", "subject"), subject)
        keys = auth.tokens.node_keys(node)
        if not keys:
            raise InvalidInput([{"field": "node", "loc": ["path", "node"], "type": "value_error",
                                 "msg": f"node {node!r} has no token here: it could not check "
                                 "a voucher"}])
        expires = clock() + VOUCHER_TTL
        voucher = issue(keys, node=node, purpose=str(purpose), subject=subject,
                        expires_at=expires, nonce=uuid.uuid4().hex)
        log.info("voucher issued", extra={"node": printable(node), "purpose": purpose,
                                          "subject": printable(subject)})
        return JSONResponse({"voucher": voucher, "expires_at": format_go_time(expires)})

    return router
