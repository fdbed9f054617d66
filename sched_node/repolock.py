"""The repository lock: jobs of one repository never run at once anywhere in the fleet.

A row with ``repo_lock`` holds one slot of the Prefect global concurrency limit
``sched-repo-<repo_id>`` around its command (every try of it), through Prefect's
client. The limit is created with one slot the first time a job needs it (two
nodes creating it at once is fine: the second finds it). A job waits for the
slot at most the action's longest run, saying in its log what it waits for and
how long it waited; when it does not get it, the job fails, saying so. The
server keeps the slot as a lease the node renews (every :data:`LEASE_S` / 3), so
a node that dies frees the slot when its lease runs out.

This is the one policy that needs the center: a fleet-wide lock lives on the
Prefect server. While the server cannot be reached, a ``repo_lock`` job waits
for it (within the same bound) instead of running unguarded.

An operator may raise the limit or deactivate it (``prefect gcl update``); the
job then logs a warning that jobs of the repository may overlap.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sched_core import SchedError
from sched_node.prefect_api import PrefectApi, PrefectRefused, PrefectUnavailable

LEASE_S = 300.0
"""How long the server keeps a slot whose holder stopped renewing it (seconds)."""
POLL_S = 2.0
"""How often a waiting job asks for the slot again."""


class RepoLockTimeout(SchedError, TimeoutError):
    """The repository lock was not free within the job's wait."""


def repo_lock_name(repo_id: str) -> str:
    """Return the global concurrency limit of a repository: ``sched-repo-<repo_id>``."""
    return f"sched-repo-{repo_id}"


def ensure_limit(api: PrefectApi, name: str, warn: Callable[[str], object]) -> None:
    """Create the limit with one slot unless it exists; warn if it no longer holds jobs apart."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    try:
        found = api.call(lambda c: c.read_global_concurrency_limit_by_name(name),
                         f"read the concurrency limit {name}")
    except PrefectRefused as exc:
        if exc.status != 404:
            raise
        try:
            api.call(lambda c: c.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=name, limit=1, active=True)),
                f"create the concurrency limit {name}")
        except PrefectRefused as again:
            if again.status != 409:  # 409: another node created it meanwhile
                raise
        return
    if not found.active or found.limit != 1:
        warn(f"the repository lock {name} is {'active' if found.active else 'inactive'} "
             f"with {found.limit} slot(s) on the Prefect server: jobs of this "
             "repository may overlap (set it back with `prefect gcl update`)")


@contextmanager
def repo_lock(
    api: PrefectApi,
    repo_id: str,
    *,
    wait_s: float,
    info: Callable[[str], object],
    warn: Callable[[str], object],
) -> Iterator[None]:
    """Hold the repository's lock while the block runs; RepoLockTimeout when it stays taken."""
    name = repo_lock_name(repo_id)
    info(f"waiting for the repository lock {name}: jobs of repository {repo_id} run one at "
         f"a time across the fleet (up to {wait_s:g} s)")
    started = time.monotonic()
    deadline = started + wait_s
    lease: str | None = None
    ensured = False
    while lease is None:
        try:
            if not ensured:
                ensure_limit(api, name, warn)
                ensured = True
            lease = str(api.call(lambda c: c.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S),
                f"take a slot of {name}").json()["lease_id"])
        except PrefectRefused as exc:
            if exc.status != 423:  # 423: taken; anything else is a real refusal
                raise
        except PrefectUnavailable:
            pass  # the lock is the server's: wait for it as for a taken slot
        if lease is None:
            if time.monotonic() >= deadline:
                raise RepoLockTimeout(
                    f"the repository lock {name} was not free within {wait_s:g} s: another "
                    f"job of repository {repo_id} held it (or the Prefect server was "
                    "unreachable) all that time")
            time.sleep(POLL_S)
    info(f"holding the repository lock {name} (waited {time.monotonic() - started:.1f} s)")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_S / 3):
            try:
                api.call(lambda c: c.renew_concurrency_lease(uuid.UUID(lease),
                                                             lease_duration=LEASE_S),
                         f"renew the lease of {name}")
            except SchedError as exc:
                warn(f"could not renew the repository lock {name}: {exc}")

    renewer = threading.Thread(target=renew, name=f"repo-lock-{repo_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        try:
            api.call(lambda c: c.release_concurrency_slots_with_lease(uuid.UUID(lease)),
                     f"release the lease of {name}")
        except SchedError as exc:
            warn(f"could not release the repository lock {name} (its lease ends by itself "
                 f"within {LEASE_S:g} s): {exc}")
