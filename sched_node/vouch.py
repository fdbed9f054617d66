"""Which ad hoc runs and cancels the node takes from Prefect (the ``ad_hoc_runs`` setting).

Rule: with ``ad_hoc_runs = "prefect"`` (the default) the node takes every run and cancel
of its deployments, as any Prefect worker does: anyone with the Prefect API may run or
cancel its jobs. With ``"controller"`` it takes a run of a schedule's job, an ad hoc
chain, the UI's Retry and a cancel only with a voucher its controller issued for exactly
that (:mod:`sched_core.vouchers`), each voucher once: ``sched run`` and ``sched cancel``
bring one; the UI's Run, Retry and Cancel do not, and the node says so on the run.
Reconcile runs need none (a reconcile only pulls from the controller).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from sched_core.statefile import locked, read_json_file, write_atomic
from sched_core.values import format_go_time, parse_go_time
from sched_core.vouchers import VoucherRefused, token_key, verify
from sched_node.registration import CHAIN, RUN_JOB

PREFECT = "prefect"
CONTROLLER = "controller"
HOW_TO = ("this node takes ad hoc runs and cancels only when its controller vouches for them "
          "(ad_hoc_runs = \"controller\"): use `sched run` or `sched cancel`")
"""The end of every refusal: what to do instead."""
MAX_NONCES = 10_000
RETRY = "AwaitingRetry"


class Vouchers:
    """The node's check of vouchers, and the nonces it took (kept until they expire)."""

    def __init__(self, path: Path, *, node: str, mode: str,
                 token: Callable[[], str | None], clock: Callable[[], datetime]) -> None:
        self.path = path
        self.node = node
        self.required = mode == CONTROLLER
        self._token = token
        self._clock = clock
        self._lock = threading.Lock()

    def refusal(self, voucher: object, *, purpose: str, subject: str) -> str | None:
        """Return why the node refuses purpose on subject (None: it takes it), taking the
        voucher's nonce when it vouches."""
        if not self.required:
            return None
        token = self._token()
        if not token:
            return f"refused: the node has no controller token to check vouchers with; {HOW_TO}"
        now = self._clock()
        try:
            found = verify(voucher, token_key(token), node=self.node, purpose=purpose,
                           subject=subject, now=now)
            self._take(found.nonce, found.expires_at, now)
        except VoucherRefused as exc:
            return f"refused: {exc}; {HOW_TO}"
        except OSError as exc:
            return f"refused: the node cannot note the voucher as used ({exc})"
        return None

    def _take(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        with self._lock, locked(self.path):
            data = read_json_file(self.path, now=now, max_depth=3)
            taken = data if isinstance(data, dict) else {}
            kept: dict[str, str] = {}
            for key, until in taken.items():
                try:
                    end = parse_go_time(until)
                except ValueError:
                    continue
                if end is not None and end > now:
                    kept[str(key)] = str(until)
            if nonce in kept:
                raise VoucherRefused("the voucher was used already")
            if len(kept) >= MAX_NONCES:
                raise VoucherRefused("too many vouchers in use at once")
            kept[nonce] = format_go_time(expires_at)
            write_atomic(self.path, json.dumps(kept, separators=(",", ":")).encode())


_IN_MESSAGE = re.compile(r"voucher=(v1\.[A-Za-z0-9_.-]{1,2000})")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def voucher_in(message: object) -> str | None:
    """Return the voucher a state's message carries (``... voucher=v1....``), if any."""
    found = _IN_MESSAGE.search(message) if isinstance(message, str) else None
    return found.group(1) if found else None


def needs(run: dict[str, Any], flow: str, node: str) -> tuple[object, str, str] | None:
    """Return what a run of flow must bring (its voucher, the purpose, the subject); None
    when it needs none (a reconcile)."""
    state = run.get("state") or {}
    params = run.get("parameters") or {}
    if state.get("type") == "CANCELLING":
        return voucher_in(state.get("message")), "cancel", str(run["id"])
    # A retried run brings its first voucher again: used already, so the Retry is refused.
    if flow == RUN_JOB:
        return params.get("voucher"), "run", str(params.get("schedule_id"))
    if flow == CHAIN:
        return params.get("voucher"), "chain", node
    return None


def refused_state(run: dict[str, Any], why: str,
                  states: Callable[[], list[dict[str, Any]]]) -> tuple[str, str | None, str]:
    """Return the state (type, name, message) a refused run goes to: a refused cancel's run
    runs on, a refused Retry's run goes back to the end it had, a refused run fails."""
    state = run.get("state") or {}
    if state.get("type") == "CANCELLING":
        return "RUNNING", None, f"cancel {why}"
    if state.get("name") == RETRY:
        for earlier in reversed(states()):
            if earlier.get("type") in FINAL:
                return (str(earlier["type"]), earlier.get("name"),
                        f"{earlier.get('message') or ''} (the UI's Retry was {why})".strip())
    return "FAILED", None, why


def door_key(state_dir: Path) -> str:
    """Return the local door's key (made once, 0600, in the state folder): with
    ``ad_hoc_runs = "controller"`` only the flows the node's own engine runs (a vouched
    chain) may hand it jobs, not those a Prefect worker on the host runs for anyone."""
    path = state_dir / "door.key"
    try:
        key = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        key = ""
    if len(key) != 64 or not all(char in "0123456789abcdef" for char in key):
        key = secrets.token_hex(32)
        write_atomic(path, key.encode())
    return key
