"""The agents' schedule store (controller.schedules), on a SQLite file and on a real Postgres."""

from __future__ import annotations

from sqlalchemy import text
from sqlmodel import Session

from controller import schedules
from tests.factories import schedule_row


def test_put_schedule_versions_from_one_and_ignores_the_sent_version(session: Session) -> None:
    first = schedules.put_schedule(session, "node-a", schedule_row("s-1"))
    renamed = schedule_row("s-1", name="renamed", version=1)
    second = schedules.put_schedule(session, "node-a", renamed)
    assert (first.version, second.version) == (1, 2)
    stored = schedules.get_schedule(session, "node-a", "s-1")
    assert stored == second
    assert stored is not None and stored.name == "renamed" and stored.params == {"threads": 4}
    assert schedules.get_schedule(session, "node-b", "s-1") is None


def test_list_schedules_is_per_node_sorted_in_wire_format(session: Session) -> None:
    for schedule_id in ("s-2", "s-10", "s-1"):
        bare = schedule_row(schedule_id, storage="", params=None)
        schedules.put_schedule(session, "node-a", bare)
    schedules.put_schedule(session, "node-b", schedule_row("s-9"))
    rows, _ = schedules.list_schedules(session, "node-a")
    assert [r.id for r in rows] == ["s-1", "s-10", "s-2"]
    assert '"storage"' not in rows[0].model_dump_json()
    assert schedules.list_nodes(session) == ["node-a", "node-b"]


def test_etag_changes_on_every_change_and_only_then(session: Session) -> None:
    assert schedules.list_schedules(session, "node-a") == ([], '"empty"')
    seen = []
    schedules.put_schedule(session, "node-a", schedule_row("s-1"))
    seen.append(schedules.list_schedules(session, "node-a")[1])
    assert schedules.list_schedules(session, "node-a")[1] == seen[-1]  # stable
    schedules.put_schedule(session, "node-b", schedule_row("s-1"))  # another node's change
    assert schedules.list_schedules(session, "node-a")[1] == seen[-1]
    schedules.put_schedule(session, "node-a", schedule_row("s-2"))  # add
    seen.append(schedules.list_schedules(session, "node-a")[1])
    schedules.put_schedule(session, "node-a", schedule_row("s-2"))  # identical update still counts
    seen.append(schedules.list_schedules(session, "node-a")[1])
    assert schedules.delete_schedule(session, "node-a", "s-2") is True  # delete
    seen.append(schedules.list_schedules(session, "node-a")[1])
    assert schedules.delete_schedule(session, "node-a", "s-2") is False  # nothing changed
    assert schedules.list_schedules(session, "node-a")[1] == seen[-1]
    assert len(set(seen)) == len(seen)
    assert all(tag.startswith('"') and tag.endswith('"') for tag in seen)
    assert schedules.node_etag(session, "node-a") == seen[-1]
    assert schedules.node_etag(session, "node-z") == '"empty"'


def test_deleting_the_last_row_drops_the_node_but_keeps_a_new_etag(session: Session) -> None:
    schedules.put_schedule(session, "node-a", schedule_row("s-1"))
    _, before = schedules.list_schedules(session, "node-a")
    schedules.delete_schedule(session, "node-a", "s-1")
    rows, after = schedules.list_schedules(session, "node-a")
    assert rows == [] and after not in (before, '"empty"')
    assert schedules.list_nodes(session) == []


POLICIES: dict[str, object] = {
    "timezone": "Australia/Adelaide", "overlap": "cancel-other", "jitter": 90,
    "catchup_window": 7200, "paused": {"note": "swap <disk> & test", "until": None},
    "not_before": "2026-01-01T00:00:00.5Z", "not_after": "2027-01-01T00:00:00Z",
    "blackouts": [{"days": ["fri", "sat"], "from": "23:00", "to": "24:00"}],
    "min_interval": 604800, "repo_lock": True,
}


def test_policies_are_stored_and_every_read_gives_the_same_row(session: Session) -> None:
    given = schedule_row("s-1", **POLICIES)
    stored = schedules.put_schedule(session, "node-a", given)
    assert stored == given.model_copy(update={"version": 1})
    assert schedules.get_schedule(session, "node-a", "s-1") == stored
    assert schedules.list_schedules(session, "node-a")[0] == [stored]
    wires, _ = schedules.list_wire(session, "node-a")
    assert wires == [stored.model_dump_json()]
    assert '"paused":{"note":"swap \\u003cdisk\\u003e \\u0026 test"}' in wires[0]


def test_a_row_without_policies_stores_none_and_a_cleared_policy_goes(session: Session) -> None:
    schedules.put_schedule(session, "node-a", schedule_row("s-1", jitter=30))
    cleared = schedules.put_schedule(session, "node-a", schedule_row("s-1"))
    assert cleared.jitter == 0 and '"jitter"' not in cleared.model_dump_json()
    assert schedules.list_wire(session, "node-a")[0] == [cleared.model_dump_json()]
    column = session.execute(
        text("SELECT policies FROM agent_schedule WHERE node = 'node-a' AND id = 's-1'")
    ).scalar_one()
    assert column is None
