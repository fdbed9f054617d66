"""Rows checked when written, against the action table their node published.

Rule: a node publishes its action table (each action's argv templates, parameters and
rules; never its ``env``) in its reports. A written row (PUT, PATCH) is rendered with the
node's own code (:func:`sched_core.render.render_argv`, ``lexical``) against the node's
latest table: a row the node would refuse is refused (422) with the node's own message; a
row for a node whose table the controller does not hold yet is accepted, and its answer
and the log say it was not checked. Two checks stay the node's alone: symlinks under a
path's roots (they are on the node's disk) and ``pattern`` rules (a node's regex never
runs on the controller).

The node sends the table with its first report after each start, and its hash with every
report; a report whose hash the controller does not hold is answered with the header
``Sched-Contract: wanted``, and the node sends the table again.
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import Table, select
from sqlmodel import Session

from controller.db import transaction
from controller.errors import InvalidInput
from controller.models import NodeContract
from sched_core.action_specs import ActionSpec, action_of
from sched_core.errors import ConfigError
from sched_core.model import LocalSchedule
from sched_core.plan import TRIGGER_SCHEDULE
from sched_core.render import render_argv
from sched_core.values import check_identifier

log = logging.getLogger("controller.contracts")

_CONTRACT: Table = NodeContract.__table__  # type: ignore[attr-defined]

MAX_ACTIONS = 200
"""The most actions a published table may hold."""
WANTED_HEADER = "Sched-Contract"
"""The report answer's header asking the node for its table (value ``wanted``)."""
STATE_DIR = Path("/node-state")
"""What ``{state_dir}`` stands for when a row is rendered on the controller."""


class NodeContractIn(BaseModel):
    """A node's published action table: its actions by name, never with an ``env``."""

    model_config = ConfigDict(extra="forbid")

    actions: Annotated[dict[str, ActionSpec], Field(max_length=MAX_ACTIONS)]

    @field_validator("actions")
    @classmethod
    def _plain(cls, actions: dict[str, ActionSpec]) -> dict[str, ActionSpec]:
        for name, spec in actions.items():
            check_identifier(name, "action")
            if spec.env:
                raise ValueError(f"action {name!r}: an action's env is never published")
        return actions


def contract_data(contract: NodeContractIn) -> dict[str, Any]:
    """Return the table as it is stored (JSON data)."""
    return {"actions": {name: spec.model_dump(mode="json", exclude={"env"}, exclude_defaults=True)
                        for name, spec in sorted(contract.actions.items())}}


def note_report(session: Session, node: str, contract_hash: str | None,
                contract: NodeContractIn | None, *, at: datetime) -> bool:
    """Store the table a report brings; return whether the controller wants the node's
    table (the report names a hash the controller does not hold). Commits."""
    if contract_hash is None:
        return False  # an agent that publishes no table
    if contract is None:
        held = session.execute(select(_CONTRACT.c.contract_hash)
                               .where(_CONTRACT.c.node == node)).scalar_one_or_none()
        session.commit()
        return held != contract_hash
    with transaction(session):
        session.execute(_CONTRACT.delete().where(_CONTRACT.c.node == node))
        session.execute(_CONTRACT.insert().values(
            node=node, contract_hash=contract_hash, contract=contract_data(contract),
            received_at=at))
    log.info("node published its action table", extra={
        "node": node, "contract_hash": contract_hash, "actions": sorted(contract.actions)})
    return False


def check_row(session: Session, node: str, row: LocalSchedule, *,
              now: datetime) -> dict[str, Any]:
    """Check row as its node would render it; return ``{"checked": bool, "check": note}``
    for the write's answer. Raises InvalidInput with the node's message when it would
    refuse the row."""
    found = session.execute(select(_CONTRACT.c.contract, _CONTRACT.c.received_at)
                            .where(_CONTRACT.c.node == node)).first()
    session.commit()  # the read's transaction ends: the write begins its own
    if found is None:
        note = (f"not checked: node {node!r} has not published its action table (it does "
                "with its first report); the node checks the row at each window")
        log.warning("schedule written unchecked: its node's action table is not known",
                    extra={"node": node, "schedule_id": row.id})
        return {"checked": False, "check": note}
    try:
        actions = NodeContractIn.model_validate(found.contract).actions
    except ValidationError:
        return {"checked": False,
                "check": f"not checked: node {node!r}'s published action table is unreadable"}
    try:
        spec = action_of(actions, row.action)
        render_argv(spec, row, state_dir=STATE_DIR, node=node, window=None,
                    trigger_key=TRIGGER_SCHEDULE, now=now, lexical=True)
    except ConfigError as exc:
        raise InvalidInput([{
            "field": "action", "loc": ["body"], "type": "refused_by_node",
            "msg": f"node {node!r} would refuse this row: {exc}"}]) from None
    return {"checked": True, "check": "checked against the action table node "
            f"{node!r} published at {found.received_at.isoformat()}"}
