"""The repository lock: jobs of one repository never run at once anywhere in the fleet.

A row with ``repo_lock`` holds one slot of the Prefect global concurrency limit
``sched-repo-<repo_id>`` around its command (every try of it). The limit is
created with one slot the first time a job needs it (two nodes creating it at
once is fine: the second finds it). A job waits for the slot at most the
action's longest run, saying in its logs what it waits for and how long it
waited; when it does not get it, the run fails, saying so. The server keeps
the slot as a lease the job renews, so a job whose process dies frees the
slot when its lease runs out (``LEASE_S``).

An operator may raise the limit or deactivate it (``prefect gcl update``);
the job then logs a warning that jobs of the repository may overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from sched_core import SchedError
from sched_core.model import LocalSchedule

LEASE_S = 300.0
"""How long the server keeps a slot whose holder stopped renewing it (seconds)."""


class RepoLockTimeout(SchedError, TimeoutError):
    """The repository lock was not free within the job's wait."""


def repo_lock_name(repo_id: str) -> str:
    """Return the global concurrency limit of a repository: ``sched-repo-<repo_id>``."""
    return f"sched-repo-{repo_id}"


def ensure_repo_limit(name: str, warn: Callable[[str], object]) -> None:
    """Create the limit with one slot unless it exists; warn if it no longer holds jobs apart."""
    with get_client(sync_client=True) as client:
        try:
            found = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1, active=True)
                )
            except ObjectAlreadyExists:
                pass  # another node created it meanwhile
            return
    if not found.active or found.limit != 1:
        warn(
            f"the repository lock {name} is {'inactive' if not found.active else 'active'} "
            f"with {found.limit} slot(s) on the Prefect server: jobs of this repository may "
            "overlap (set it back with `prefect gcl update`)"
        )


@contextmanager
def repo_lock(
    row: LocalSchedule,
    *,
    wait_s: float,
    info: Callable[[str], object],
    warn: Callable[[str], object],
) -> Iterator[None]:
    """Hold the row's repository lock while the block runs (nothing when repo_lock is off)."""
    if not row.repo_lock:
        yield
        return
    name = repo_lock_name(row.repo_id)
    ensure_repo_limit(name, warn)
    info(f"waiting for the repository lock {name}: jobs of repository {row.repo_id} run one at "
         f"a time across the fleet (up to {wait_s:g} s)")
    started = time.monotonic()
    with ExitStack() as held:
        try:
            held.enter_context(concurrency(
                name, occupy=1, timeout_seconds=wait_s, strict=True, lease_duration=LEASE_S
            ))
        except TimeoutError as exc:
            raise RepoLockTimeout(
                f"the repository lock {name} was not free within {wait_s:g} s: another job of "
                f"repository {row.repo_id} held it all that time"
            ) from exc
        info(f"holding the repository lock {name} (waited {time.monotonic() - started:.1f} s)")
        yield
