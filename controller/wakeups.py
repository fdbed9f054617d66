"""Wake-ups after a task save: the Postgres NOTIFY channel, and in-process wakers.

Rule: a save wakes every scheduler that could dispatch the task sooner. On
Postgres the save's own transaction sends ``NOTIFY sched_task, '<name>'``
(:mod:`controller.tasks`), which every instance's listener hears
(:mod:`controller.listener`); SQLite has no NOTIFY, so a save also sets the
waker of every scheduler of this process on the same database, after the
commit. Wakers are keyed by the database's full URL, which is never logged.
"""

from __future__ import annotations

import threading

from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session

NOTIFY_CHANNEL = "sched_task"
"""The Postgres channel a task save notifies (payload: the task name)."""

_local_wakers: dict[str, set[threading.Event]] = {}
_wakers_lock = threading.Lock()


def _url_key(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def subscribe_saves(engine: Engine, waker: threading.Event) -> None:
    """Set waker whenever a task is saved through any engine of this process on that database."""
    with _wakers_lock:
        _local_wakers.setdefault(_url_key(engine), set()).add(waker)


def unsubscribe_saves(engine: Engine, waker: threading.Event) -> None:
    """Undo :func:`subscribe_saves`."""
    with _wakers_lock:
        wakers = _local_wakers.get(_url_key(engine))
        if wakers is not None:
            wakers.discard(waker)
            if not wakers:
                del _local_wakers[_url_key(engine)]


def wake_local(session: Session) -> None:
    """Set every waker subscribed to the database of session's engine (after a commit)."""
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    with _wakers_lock:
        wakers = list(_local_wakers.get(_url_key(engine), ()))
    for waker in wakers:
        waker.set()
