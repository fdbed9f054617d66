"""The overlap policy on this node: what a run does while a job of its schedule is active.

A job holds its schedule's slot on this node, an exclusive ``flock`` on
``<state_dir>/jobs/<schedule id>.lock``, from after the start guard until its
command ends. The kernel frees the slot when the process ends, however it
ends (a crash, ``kill -9``, a cancellation), so no stale record can block a
schedule. A run that the start guard skipped never takes it, so the runs a
node starts together after downtime (all but one coalesced) do not count as
active. The row's ``overlap`` says what a run does when the slot is taken:

- ``skip`` (the default): it ends Skipped, naming the run that holds the slot;
- ``allow``: it takes no slot and runs alongside;
- ``buffer-one``: it waits for the slot, at most the action's longest run
  (its timeout times its tries, plus the retry delays); one run waits at a
  time (it holds ``<id>.wait``), and a later one is skipped;
- ``cancel-other``: it asks Prefect to cancel the run that holds the slot (the
  worker or ``serve`` running it stops its process), then takes the slot
  when it is free, waiting as ``buffer-one`` does.

The holder records its flow run's id and name beside the lock
(``<id>.holder``, JSON), so the others can name it in their messages and
cancel it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas import OrchestrationResult
from prefect.states import Cancelling

from sched_core.model import LocalSchedule, Overlap
from sched_core.statefile import write_atomic

log = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a waiting run tries the slot again (seconds)."""


@dataclass(frozen=True)
class Holder:
    """The run that holds a schedule's slot, as it recorded itself."""

    run_id: str
    run_name: str
    since: str

    def __str__(self) -> str:
        if not self.run_id:
            return "a run that has not recorded itself yet"
        return f"run {self.run_name} ({self.run_id}, since {self.since})"


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def read_holder(path: Path) -> Holder:
    """Return the holder recorded at path; an empty one when missing or unreadable."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return Holder("", "", "")
    if not isinstance(data, dict):
        return Holder("", "", "")
    return Holder(str(data.get("run_id", "")), str(data.get("run_name", "")),
                  str(data.get("since", "")))


def _wait(fd: int, deadline: float) -> bool:
    while True:
        if _try_lock(fd):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


@contextmanager
def job_slot(
    folder: Path,
    row: LocalSchedule,
    *,
    run_id: str,
    run_name: str,
    now: datetime,
    wait_s: float,
    info: Callable[[str], object],
    cancel: Callable[[str, str], None],
) -> Iterator[str | None]:
    """Hold row's slot on this node while the block runs; yield None, or why the run must not run.

    ``folder`` is the node's ``jobs`` folder; ``now`` is recorded as when the
    holder started; ``info`` logs to the run;
    ``cancel(run_id, message)`` asks Prefect to cancel a run (cancel-other).
    """
    mode = row.overlap or Overlap.SKIP
    if mode is Overlap.ALLOW:
        yield None
        return
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_path, holder_path = folder / f"{row.id}.lock", folder / f"{row.id}.holder"
    fd = _open_lock(lock_path)
    waiting: int | None = None
    try:
        if not _try_lock(fd):
            holder = read_holder(holder_path)
            busy = f"a job of schedule {row.id} is still active on this node: {holder}"
            if mode is Overlap.SKIP:
                yield f"{busy}; overlap skip"
                return
            waiting = _open_lock(folder / f"{row.id}.wait")
            if not _try_lock(waiting):
                yield f"{busy}, and another run already waits for it; overlap {mode.value}"
                return
            if mode is Overlap.CANCEL_OTHER and holder.run_id:
                info(f"cancelling {holder} (overlap cancel-other)")
                cancel(holder.run_id, f"cancelled by {run_name} ({run_id}): overlap "
                                      f"cancel-other of schedule {row.id}")
            info(f"waiting for {holder} to end (overlap {mode.value}, up to {wait_s:g} s)")
            started = time.monotonic()
            if not _wait(fd, started + wait_s):
                yield (f"{busy}; waited {wait_s:g} s for it to end (overlap {mode.value}), "
                       "and it did not")
                return
            info(f"{holder} ended; running after {time.monotonic() - started:.1f} s")
            os.close(waiting)
            waiting = None
        since = now.astimezone(UTC).isoformat(timespec="seconds")
        try:
            write_atomic(holder_path, json.dumps(
                {"run_id": run_id, "run_name": run_name, "since": since}).encode())
        except OSError as exc:  # the slot is held all the same; others only cannot name it
            log.warning("could not record the holder of %s: %r", lock_path, exc,
                        extra={"schedule_id": row.id, "path": str(holder_path),
                               "error": repr(exc)})
        try:
            yield None
        finally:
            try:
                holder_path.unlink()
            except FileNotFoundError:
                pass
    finally:
        if waiting is not None:
            os.close(waiting)
        os.close(fd)  # closing the descriptor releases the flock


def longest_run_s(timeout_s: float, retries: int, retry_delay_s: float) -> float:
    """Return how long one job of an action can run: every try, and the delays between."""
    return timeout_s * (retries + 1) + retry_delay_s * retries


def cancel_run(run_id: str, message: str) -> None:
    """Ask Prefect to cancel a run: its worker or ``serve`` stops its process (cancel-other)."""
    try:
        with get_client(sync_client=True) as client:
            result: OrchestrationResult[Any] = client.set_flow_run_state(
                UUID(run_id), Cancelling(message=message)
            )
    except Exception as exc:  # the run may be gone or the API down: the wait decides
        log.warning("could not cancel run %s: %r", run_id, exc,
                    extra={"flow_run_id": run_id, "error": repr(exc)})
        return
    log.info("asked to cancel run %s: %s", run_id, result.status.value,
             extra={"flow_run_id": run_id, "status": result.status.value})
