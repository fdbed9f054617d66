"""The day's chain as one run, pure: a chain day's stages from its folder's entries, and
when it ends (sched_node.chain_run); and which of a job's flow-run states a server holds
already after a kill (sched_node.record_steps.sent_states)."""

from __future__ import annotations

from typing import Any

from sched_node.chain_run import chain_end, stages_of
from sched_node.outbox import COMPLETED, FAILED
from sched_node.prefect_api import new_state
from sched_node.record_steps import sent_states

AT = "2026-12-07T07:30:00Z"


def _fired(stage: str, schedule_id: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"e": "fired", "stage": stage, "at": AT}
    if schedule_id:
        entry["schedule_id"] = schedule_id
    return entry


def _ended(stage: str, schedule_id: str, state: str) -> dict[str, Any]:
    return {"e": "job_end", "stage": stage, "schedule_id": schedule_id, "state": state,
            "at": AT}


def test_a_chain_day_ends_once_its_last_stage_fired_and_every_job_ended() -> None:
    entries = [_fired("prune", "p-1"), _fired("prune", "p-2")]
    assert [stage.name for stage in stages_of(entries)] == ["prune"]
    assert chain_end(stages_of(entries), "check") is None, "check has not fired"
    entries += [_ended("prune", "p-1", COMPLETED), _ended("prune", "p-2", COMPLETED),
                _fired("check", "c-1")]
    assert chain_end(stages_of(entries), "check") is None, "check's job runs"
    entries.append(_ended("check", "c-1", COMPLETED))
    assert chain_end(stages_of(entries), "check") == (
        COMPLETED, "prune: 2 job(s); check: 1 job(s)")


def test_a_failed_job_fails_its_stage_and_the_chain_naming_it() -> None:
    entries = [_fired("prune", "p-1"), _ended("prune", "p-1", FAILED),
               _fired("check", "c-1"), _ended("check", "c-1", COMPLETED)]
    stages = stages_of(entries)
    assert [(stage.name, stage.done, stage.ok) for stage in stages] == [
        ("prune", True, False), ("check", True, True)]
    assert chain_end(stages, "check") == (FAILED, "prune: p-1 Failed")


def test_a_stage_with_no_schedule_is_done_at_once_and_an_unknown_stage_is_left_out() -> None:
    entries = [_fired("prune"), _ended("other", "x-1", COMPLETED), _fired("check", "c-1"),
               _ended("check", "c-1", COMPLETED), {"e": "fired", "stage": "bad"}]
    stages = stages_of(entries)
    assert [(stage.name, stage.jobs) for stage in stages] == [("prune", []), ("check", ["c-1"])]
    assert chain_end(stages, "check") == (COMPLETED, "prune: 0 job(s); check: 1 job(s)")


def test_the_states_sent_before_a_kill_are_read_off_the_end_of_the_runs_history() -> None:
    wanted = [new_state("RUNNING"), new_state("SCHEDULED", name="AwaitingRetry"),
              new_state("RUNNING", name="Retrying"), new_state("FAILED")]

    def server(*names: tuple[str, str]) -> list[dict[str, Any]]:
        return [{"type": kind, "name": name} for kind, name in names]

    planned = ("SCHEDULED", "Scheduled")
    assert sent_states(server(planned), wanted) == 0
    assert sent_states(server(planned, ("RUNNING", "Running")), wanted) == 1
    assert sent_states(server(planned, ("RUNNING", "Running"),
                              ("SCHEDULED", "AwaitingRetry")), wanted) == 2
    assert sent_states(server(planned, ("RUNNING", "Running"), ("SCHEDULED", "AwaitingRetry"),
                              ("RUNNING", "Retrying"), ("FAILED", "Failed")), wanted) == 4
    # A retry from the UI before this job: the earlier job's states are not this one's.
    earlier = server(planned, ("RUNNING", "Running"), ("FAILED", "Failed"),
                     ("SCHEDULED", "AwaitingRetry"), ("PENDING", "Pending"))
    assert sent_states(earlier, wanted) == 0
    assert sent_states([*earlier, {"type": "RUNNING", "name": "Running"}], wanted) == 1
