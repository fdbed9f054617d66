"""What identifies one job in Prefect: its run's name, tags, parameters and idempotency key.

Pure: no I/O. A run carries the job's identity, never its row: its parameter
``schedule_id``, its name (action, schedule, window), its tags (node, action, schedule,
trigger) and its idempotency key. Every run the node makes has an idempotency
key (``<node>:<window key>`` for a window, ``<node>:<id>@<stage>@<day>`` for a
chain stage), so the planner's run of a window and the node's record of the job
that ran it are one run, whoever creates it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sched_core.render import window_stamp

AGENT_TAG = "sched-agent"
"""The tag every deployment of the agent carries (and so every run of it)."""


def job_tags(node: str, action: str, schedule_id: str, trigger_key: str) -> list[str]:
    """Return the tags a job's run carries (node, action, schedule and trigger)."""
    return [f"node:{node}", f"action:{action}", f"schedule:{schedule_id}",
            f"trigger:{trigger_key}"]


def job_run_name(action: str, schedule_id: str, window: datetime | None, *,
                 now: datetime | None = None) -> str:
    """Return a job's run name: action, schedule and window (``backup-s-1-20261202T0730Z``)."""
    return f"{action}-{schedule_id}-{window_stamp(window, now=now)}"


@dataclass(frozen=True)
class JobRef:
    """The identity of one job: node, action, schedule, trigger, window and key."""

    node: str
    action: str
    schedule_id: str
    trigger_key: str
    window: datetime | None
    key: str

    def name(self, *, now: datetime | None = None) -> str:
        """Return the run's name (``backup-s-1-20261202T0730Z``)."""
        return job_run_name(self.action, self.schedule_id, self.window, now=now)

    @property
    def idempotency_key(self) -> str:
        """Return the run's idempotency key: the node and the kit's key."""
        return f"{self.node}:{self.key}"

    def tags(self) -> list[str]:
        """Return the run's tags."""
        return [AGENT_TAG, *job_tags(self.node, self.action, self.schedule_id, self.trigger_key)]

    def parameters(self) -> dict[str, Any]:
        """Return the run's parameters as its flow (``run_job``) takes them: the schedule, and
        never the row or a time (anyone with the Prefect API sets parameters). The window is
        in the run's name and its idempotency key, the trigger in its tags."""
        return {"schedule_id": self.schedule_id}
