"""The controller's alerts: a silent node, a missed or failed window, and their recovery.

Every ``interval`` seconds one instance takes the fleet's turn (:func:`take_turn`, a
compare-and-set on the ``watch_turn`` row with the database's clock; the first instance to
ask once 0.9 of an interval has passed) and reads the fleet's report
(:func:`controller.ledger.fleet_report`) since its own previous pass plus the longest grace
plus :data:`MARGIN` (:data:`LOOKBACK` at its first pass). The pure
:func:`controller.alert_rules.plan_alerts` decides which alerts to raise and which a
success resolves:

- ``node-silent`` (``sched.node.silent``): a node silent past its heartbeats
  (:mod:`controller.fleet` rule 2), or never seen with a missed window;
- ``window-missed`` / ``window-failed``: a window with no report past its grace
  (:mod:`controller.morning` rule 3), or whose job is Failed or Crashed; one open alert
  per (node, schedule, kind);
- ``node-recovered`` / ``window-recovered``: the node made a request again; a later
  window of the schedule completed (or the missed job was reported after all).

Exactly once, whatever the number of instances (the database decides):

1. An alert is a row of ``fleet_alert``, unique per (node, kind, subject): each instance
   inserts what it found with ``ON CONFLICT DO NOTHING``; the one whose insert wins logs it.
   A resolution sets ``resolved_at`` once.
2. A row not yet sent is claimed by a compare-and-set on its lease (``lease_until``, the
   database's clock): only the instance whose ``UPDATE`` matched sends it.
3. It sends the event (its id derived from the row's key, so a resend is one event) and
   marks the row sent; a failed send is claimed again once its lease (growing, at most
   10 min) has run out. Without a Prefect API the alert is only logged.

An instance without the turn only sends what is pending (steps 2 and 3).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult, Engine
from sqlmodel import Session

from controller import jobs, ledger, nodes, schedules
from controller.alert_rules import PROBLEMS, Alert, AlertFact, OpenAlert, plan_alerts, prefect_event
from controller.db import db_now, transaction
from controller.fleet import FleetSettings
from controller.logtext import printable
from controller.models import FleetAlert, WatchTurn, utc_now
from sched_core.values import utc_text

log = logging.getLogger(__name__)

ALERTS: Table = FleetAlert.__table__  # type: ignore[attr-defined]
_A = ALERTS.c
TURNS: Table = WatchTurn.__table__  # type: ignore[attr-defined]
INSERT_BATCH = 500
"""Alerts (and resolutions) a statement."""
TURN_SHARE = 0.9
"""A turn is free again after this share of an interval (the instances' timers drift)."""
LOOKBACK = timedelta(hours=6)
"""How far back each pass looks for missed and failed windows (and their recoveries)."""
MARGIN = timedelta(minutes=10)
"""Added to each later pass's look-back, past the longest grace and the report slack."""
DEFAULT_INTERVAL = 15.0
"""Seconds between passes."""
ALERT_RETENTION = timedelta(days=35)
"""Alerts raised longer ago than this are pruned."""
LEASE_S = 30.0
MAX_LEASE_S = 600.0


def alert_facts(session: Session, node: str, limit: int = 500) -> list[AlertFact]:
    """Return the alerts raised about node, newest first (for ``sched explain``)."""
    rows = session.execute(
        select(_A.kind, _A.subject, _A.detected_at, _A.sent_at, _A.resolved_at)
        .where(_A.node == node).order_by(_A.id.desc()).limit(limit)).all()
    return [AlertFact(*row) for row in rows]  # the columns in its fields' order


Emitter = Callable[[dict[str, Any]], None]
"""Sends one Prefect event (JSON data); raises when it was not accepted."""


def take_turn(session: Session, name: str, every_s: float, holder: str) -> bool:
    """Take name's turn if no instance took it in the last ``every_s`` x :data:`TURN_SHARE`
    seconds (the database's clock); return whether this call took it.

    One statement: an insert that, on the existing row, updates it only where its turn is
    over. Two instances asking at once: the second waits for the first's row (Postgres) or
    the write lock (SQLite), then finds the turn just taken.
    """
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    with transaction(session):
        now = db_now(session)
        taken = insert(TURNS).values(name=name, taken_at=now, holder=holder).on_conflict_do_update(
            index_elements=[TURNS.c.name], set_={"taken_at": now, "holder": holder},
            where=TURNS.c.taken_at <= now - timedelta(seconds=every_s * TURN_SHARE),
        ).returning(TURNS.c.name)
        return session.execute(taken).first() is not None


@dataclass(eq=False)
class FleetWatch:
    """Raise the fleet's alerts every ``interval`` seconds in a thread (see the module).

    ``emit`` sends one event (None: alerts are only logged); ``clock`` is the
    fleet's now (the API's). :meth:`check` runs one pass in the calling thread.
    """

    engine: Engine
    settings: FleetSettings
    _: KW_ONLY
    emit: Emitter | None
    interval: float = DEFAULT_INTERVAL
    clock: Callable[[], datetime] = utc_now
    lookback: timedelta = LOOKBACK
    raised: int = field(default=0, init=False)
    """Alerts this instance inserted (won step 1)."""
    sent: int = field(default=0, init=False)
    """Alerts this instance sent (won step 2 and sent)."""
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _last: datetime | None = field(default=None, init=False, repr=False)
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}",
                        init=False)
    """This instance, as the turn's row names it."""
    passes: int = field(default=0, init=False)
    """Passes this instance ran (turns it took)."""

    def tick(self) -> bool:
        """One step of the thread: the pass if this instance takes the fleet's turn, else
        only the sending of alerts pending (see the module). Return whether it ran the pass."""
        with Session(self.engine) as session:
            mine = take_turn(session, "fleet", self.interval, self.holder)
        if mine:
            self.passes += 1
            self.check()
        else:
            self.send_pending()
        return mine

    # ------------------------------------------------------------ one pass

    def check(self, now: datetime | None = None) -> list[Alert]:
        """Run one pass: find, insert once, resolve, send what this instance claims.

        Returns the alerts this instance inserted.
        """
        now = now or self.clock()
        with Session(self.engine) as session:
            # Read once: the look-back's graces and the report's zones and graces.
            reports = nodes.latest_reports(session)
            report = ledger.fleet_report(session, settings=self.settings, now=now,
                                         since=now - self.look_back(now, reports), until=now,
                                         reports=reports)
            session.commit()
            planned = plan_alerts(report, self.open_alerts(session))
            raised = self._insert(session, planned, now)
        self.send_pending()
        return raised

    def look_back(self, now: datetime, reports: Mapping[str, Any]) -> timedelta:
        """Return how far this pass looks back (see the module docstring), given the nodes'
        latest reports (their graces)."""
        last, self._last = self._last, now
        if last is None or last >= now:
            return self.lookback
        from controller.morning import REPORT_SLACK_S

        graces = [ledger.node_grace(report, self.settings) for report in reports.values()]
        longest = max([timedelta(seconds=self.settings.default_grace), *graces])
        wanted = (now - last) + longest + timedelta(seconds=REPORT_SLACK_S) + MARGIN
        return min(self.lookback, wanted)

    def open_alerts(self, session: Session) -> list[OpenAlert]:
        """Return the problem alerts not resolved yet."""
        rows = session.execute(
            select(_A.id, _A.node, _A.kind, _A.subject, _A.schedule_id, _A.window_at)
            .where(_A.resolved_at.is_(None), _A.kind.in_(sorted(PROBLEMS)))
            .order_by(_A.id)).all()
        session.commit()
        return [OpenAlert(int(r.id), r.node, r.kind, r.subject, r.schedule_id, r.window_at)
                for r in rows]

    def _insert(self, session: Session, planned: list[Alert], now: datetime) -> list[Alert]:
        """Step 1: insert each alert once; resolve what it resolves; return those inserted."""
        dialect = session.get_bind().dialect.name
        insert = pg_insert if dialect == "postgresql" else sqlite_insert
        first: dict[tuple[str, str, str], Alert] = {}
        for alert in planned:  # an alert proposed twice in a pass is inserted (raised) once
            first.setdefault((alert.node, alert.kind, alert.subject), alert)
        unique = list(first.values())
        inserted: set[tuple[str, str, str]] = set()
        resolves = sorted({i for alert in planned for i in alert.resolves})
        # A batch of rows a statement: a fleet gone silent at once is 10,000 alerts in a pass.
        with transaction(session):
            for begin in range(0, len(unique), INSERT_BATCH):
                stmt = insert(ALERTS).values([{
                    "node": a.node, "kind": a.kind, "subject": a.subject,
                    "schedule_id": a.schedule_id, "window_at": a.window, "reason": a.reason,
                    "payload": {**a.payload, "detected_at": utc_text(now)},
                    "detected_at": now, "attempts": 0, "resolved_at": None, "sent_at": None,
                    "lease_until": None} for a in unique[begin:begin + INSERT_BATCH]],
                ).on_conflict_do_nothing(
                    index_elements=[_A.node, _A.kind, _A.subject],
                ).returning(_A.node, _A.kind, _A.subject)
                inserted |= {(r.node, r.kind, r.subject) for r in session.execute(stmt)}
            for begin in range(0, len(resolves), INSERT_BATCH):
                session.execute(update(ALERTS).where(
                    _A.id.in_(resolves[begin:begin + INSERT_BATCH]), _A.resolved_at.is_(None)
                ).values(resolved_at=now))
        raised = [a for a in unique if (a.node, a.kind, a.subject) in inserted]
        for alert in raised:
            self.raised += 1
            level = logging.INFO if alert.kind not in PROBLEMS else logging.WARNING
            log.log(level, "fleet alert", extra={
                "node": printable(alert.node), "kind": alert.kind,
                "schedule_id": printable(alert.schedule_id or "-"),
                "reason": printable(alert.reason)})
        return raised

    def send_pending(self, limit: int = 100) -> int:
        """Steps 2 and 3: claim each unsent alert by its lease, send it, mark it; return sent."""
        sent = 0
        with Session(self.engine) as session:
            now = db_now(session)
            rows = session.execute(
                select(ALERTS).where(_A.sent_at.is_(None), or_(
                    _A.lease_until.is_(None), _A.lease_until < now))
                .order_by(_A.id).limit(limit)).all()
            session.commit()
            for row in rows:
                lease = min(LEASE_S * 2 ** min(int(row.attempts), 10), MAX_LEASE_S)
                with transaction(session):
                    claimed = cast(CursorResult[Any], session.execute(
                        update(ALERTS).where(
                            _A.id == row.id, _A.sent_at.is_(None),
                            or_(_A.lease_until.is_(None), _A.lease_until < now))
                        .values(lease_until=now + timedelta(seconds=lease),
                                attempts=_A.attempts + 1))).rowcount
                if not claimed:
                    continue  # another instance has it
                alert = {"node": row.node, "kind": row.kind, "subject": row.subject,
                         "schedule_id": row.schedule_id, "payload": row.payload}
                try:
                    if self.emit is not None:
                        self.emit(prefect_event(alert, occurred=utc_now()))
                except Exception as exc:
                    error = printable(f"{type(exc).__name__}: {exc}")[:300]
                    log.warning("could not send a fleet alert's event; retrying", extra={
                        "node": printable(row.node), "kind": row.kind, "retry_in_s": lease,
                        "error": error})
                    continue
                with transaction(session):
                    session.execute(update(ALERTS).where(_A.id == row.id).values(
                        sent_at=db_now(session)))
                sent += 1
        self.sent += sent
        return sent

    def prune(self, now: datetime) -> None:
        """Drop old job records (of nodes that stopped reporting), row versions and alerts."""
        with Session(self.engine) as session:
            with transaction(session):
                jobs.prune_all(session, now=now, keep=self.settings.job_keep)
                # Resolved or not (a deleted row's alert never is): 35 days is old news.
                session.execute(delete(ALERTS).where(_A.detected_at < now - ALERT_RETENTION))
            schedules.prune_versions(session, now=now)

    # ------------------------------------------------------------ the thread

    def start(self) -> None:
        """Run :meth:`tick` every interval in a daemon thread (and prune hourly)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sched-fleet-watch",
                                        daemon=True)
        self._thread.start()
        log.info("fleet watch started", extra={"interval_s": self.interval,
                                               "events": self.emit is not None})

    def _run(self) -> None:
        next_prune = 0.0
        import time

        while not self._stop.is_set():
            try:
                self.tick()
                if time.monotonic() >= next_prune:
                    self.prune(self.clock())
                    next_prune = time.monotonic() + 3600
            except Exception as exc:
                log.warning("fleet watch pass failed; retrying", extra={
                    "error": printable(f"{type(exc).__name__}: {exc}")[:300]})
            self._stop.wait(self.interval)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread (a pass under way finishes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
