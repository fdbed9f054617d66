"""A job of :mod:`sched_node.jobs` while it has not ended, and what one pass over the queue
decided."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sched_node import launcher
from sched_node.outbox import JobFolder, JobSpec, JobView


@dataclass
class LiveJob:
    """A job that has not ended: its folder, where it is, its keeper."""

    folder: JobFolder
    spec: JobSpec
    state: str = "queued"  # queued | running
    attempt: int = 0
    keeper: launcher.Keeper | None = None
    waiting: bool = False  # waits for a running job of its schedule (buffer-one, cancel-other)
    wait_until: float | None = None
    cancel: str | None = None
    thread: threading.Thread | None = None
    resume: JobView | None = None
    """The job's view when the node found it at start (for :meth:`sched_node.jobs.Jobs.resume`)."""
    cancelled_peers: set[str] = field(default_factory=set)


@dataclass
class Moves:
    """What one pass over the queue decided, done once the lock is let go."""

    start: list[LiveJob] = field(default_factory=list)
    end: list[tuple[LiveJob, str, str]] = field(default_factory=list)  # (job, state, reason)
    cancel: list[tuple[LiveJob, str]] = field(default_factory=list)  # (running job, message)
