"""The node's jobs with real keeper processes and real commands (no Prefect).

A restart of the node is a new :class:`sched_node.jobs.Jobs` over the same outbox, as
the next node process makes it; a keeper that was killed is one whose process
is gone without an exit file.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sched_core.policies import Peer, overlap_verdict
from sched_node import launcher
from sched_node.jobs import Jobs
from sched_node.outbox import JobSpec, JobView, Outbox, job_id_for, utc_text
from tests.procs import wait_for

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _spec(name: str, argv: list[str], *, schedule: str = "s-1", overlap: str = "allow",
          retries: int = 0, timeout: float = 30) -> JobSpec:
    now = datetime.now(UTC)
    return JobSpec(job_id=job_id_for(now, name), kind="job", node="n", schedule_id=schedule,
                   action="a", trigger_key="schedule", window=None, key=name, run_name=name,
                   idempotency_key=f"n:{name}", flow_run_id=None, planned_start=None,
                   accepted_at=now, reason="on time", argv=argv, timeout_s=timeout,
                   retries=retries, retry_delay_s=0.1, overlap=overlap)


class Node:
    """An outbox and the Jobs over it (a node process); restart() is the next process."""

    def __init__(self, root: Path, *, slots: int = 4,
                 rerun: tuple[bool, str] = (True, "allowed")) -> None:
        self.outbox = Outbox(root, max_bytes=1 << 30)
        self.ended: list[JobView] = []
        self.rerun = rerun
        self.jobs = self._jobs(slots)

    def _jobs(self, slots: int) -> Jobs:
        return Jobs(self.outbox, slots=slots, clock=lambda: datetime.now(UTC),
                    env_for=lambda spec: ENV, on_end=self.ended.append,
                    may_rerun=lambda spec: self.rerun)

    def restart(self, slots: int = 4) -> Jobs:
        self.jobs.stop()
        self.outbox = Outbox(self.outbox.root, max_bytes=1 << 30)
        self.jobs = self._jobs(slots)
        return self.jobs

    def end(self, name: str, timeout: float = 30) -> JobView:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for view in self.ended:
                if view.spec.run_name == name:
                    return view
            time.sleep(0.02)
        raise AssertionError(f"{name} did not end within {timeout} s")


def _wait_started(node: Node, name: str) -> None:
    """Wait until name's first attempt has started its command (a fixed sleep is not enough
    on a loaded machine)."""
    def started() -> bool:
        return any(folder.view().spec.run_name == name
                   and folder.attempt_path(1, "started").exists()
                   for folder in node.outbox.jobs())

    wait_for(f"{name}'s command to start", started, 30)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "outbox")
    yield made
    made.jobs.stop()


def _started(view: JobView) -> float:
    assert view.started_at is not None
    return view.started_at.timestamp()


def test_jobs_wait_for_a_slot_in_the_order_they_came(node: Node) -> None:
    jobs = node.restart(slots=1)
    jobs.accept(_spec("hog", ["sleep", "0.5"], schedule="other"))
    for n in range(3):
        jobs.accept(_spec(f"w{n}", ["true"]))
    views = [node.end(f"w{n}") for n in range(3)]
    assert [view.end_state for view in views] == ["Completed"] * 3
    assert _started(views[0]) >= _started(node.end("hog")) + 0.4
    assert _started(views[0]) < _started(views[1]) < _started(views[2])
    assert all("waiting for a job slot (all 1 are taken)" in (
        node.outbox.root / view.spec.job_id / "log.jsonl").read_text() for view in views)


def test_overlap_skip_names_the_running_job_and_allow_runs_alongside(node: Node) -> None:
    node.jobs.accept(_spec("first", ["sleep", "0.6"], overlap="skip"))
    node.jobs.accept(_spec("second", ["true"], overlap="skip"))
    second = node.end("second")
    assert second.end_state == "Skipped"
    assert second.message.startswith("a job of schedule s-1 is still active on this node: run "
                                     "first (since ")
    node.jobs.accept(_spec("a1", ["sleep", "0.4"], schedule="s-2"))
    node.jobs.accept(_spec("a2", ["sleep", "0.4"], schedule="s-2"))
    a1, a2 = node.end("a1"), node.end("a2")
    assert a1.end_state == a2.end_state == "Completed"
    assert abs(_started(a1) - _started(a2)) < 0.3, "allow: both at once"


def test_overlap_buffer_one_waits_and_a_third_is_skipped(node: Node) -> None:
    node.jobs.accept(_spec("b1", ["sleep", "0.6"], overlap="buffer-one"))
    node.jobs.accept(_spec("b2", ["true"], overlap="buffer-one"))
    node.jobs.accept(_spec("b3", ["true"], overlap="buffer-one"))
    b1, b2, b3 = node.end("b1"), node.end("b2"), node.end("b3")
    assert b1.end_state == b2.end_state == "Completed"
    assert _started(b2) >= b1.attempts[0].ended_at.timestamp()  # type: ignore[union-attr]
    assert b3.end_state == "Skipped" and "another run already waits for it" in b3.message


def test_overlap_cancel_other_stops_the_running_command_then_runs(node: Node) -> None:
    node.jobs.accept(_spec("c1", ["sleep", "30"], overlap="cancel-other"))
    _wait_started(node, "c1")
    node.jobs.accept(_spec("c2", ["true"], overlap="cancel-other"))
    c1, c2 = node.end("c1", 20), node.end("c2", 20)
    assert c1.end_state == "Cancelled" and "overlap cancel-other" in c1.message
    assert c2.end_state == "Completed"


def test_a_failing_command_is_tried_again_and_a_timeout_kills_its_group(node: Node) -> None:
    node.jobs.accept(_spec("f", ["sh", "-c", "exit 3"], retries=2))
    failed = node.end("f")
    assert failed.end_state == "Failed" and len(failed.attempts) == 3
    assert failed.message == "sh exited with code 3 (after 3 tries)"
    node.jobs.accept(_spec("t", ["sh", "-c", "sleep 30 & sleep 30"], schedule="s-t",
                           timeout=0.5))
    timed = node.end("t", 20)
    assert timed.end_state == "Failed" and "timed out after 0.5 s and was killed" in timed.message


def test_a_failure_says_why_in_the_commands_last_error_lines_with_secrets_hidden(
    tmp_path: Path,
) -> None:
    env = {**ENV, "RESTIC_PASSWORD": "hunter22", "PLAIN": "shown"}
    outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
    ended: list[JobView] = []
    jobs = Jobs(outbox, slots=2, clock=lambda: datetime.now(UTC), env_for=lambda spec: env,
                on_end=ended.append)
    try:
        script = ("echo progress; echo \"/data/projects does not exist, skipping\" >&2; "
                  "printf 'Fatal: all targets gone (pw %s, %s)\\033[0m\\n' "
                  "\"$RESTIC_PASSWORD\" \"$PLAIN\" >&2; exit 1")
        jobs.accept(_spec("why", ["sh", "-c", script]))
        wait_for("the job's end", lambda: bool(ended), 30)
    finally:
        jobs.stop()
    (view,) = ended
    assert view.end_state == "Failed"
    assert view.error == ("sh exited with code 1: /data/projects does not exist, skipping | "
                          "Fatal: all targets gone (pw [redacted], shown)\\x1b[0m")
    out = [json.loads(line) for line in (outbox.root / view.spec.job_id / "a1.out")
           .read_text().splitlines()]
    # Both streams in the run's output (their order between them is the pipes'), stderr's
    # lines marked.
    assert {(line["m"], line.get("s")) for line in out} >= {
        ("progress", None), ("/data/projects does not exist, skipping", "err")}


def test_a_cancel_stops_the_command_and_the_job_ends_cancelled(node: Node) -> None:
    node.jobs.accept(_spec("long", ["sleep", "30"]))
    _wait_started(node, "long")
    folder = node.outbox.folder(next(s.job_id for s, _ in node.jobs.active()))
    pid = json.loads(folder.attempt_path(1, "started").read_text())["pid"]
    assert node.jobs.cancel(job_id=folder.job_id, message="stop it")
    view = node.end("long", 20)
    assert view.end_state == "Cancelled" and view.message == "stop it"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_restart_follows_a_command_that_outlived_the_node_and_reads_its_outcome(
    node: Node,
) -> None:
    node.jobs.accept(_spec("outlive", ["sh", "-c", "sleep 1; echo done"]))
    _wait_started(node, "outlive")
    node.jobs.stop()  # the node process is gone (its keeper lives on)
    jobs = node.restart()
    resumed = jobs.resume()
    assert resumed == [("outlive", "taken up again")]
    view = node.end("outlive", 20)
    assert view.end_state == "Completed" and len(view.attempts) == 1
    out = (node.outbox.root / view.spec.job_id / "a1.out").read_text()
    assert json.loads(out.splitlines()[-1])["m"] == "done"
    log = (node.outbox.root / view.spec.job_id / "log.jsonl").read_text()
    assert "still running: following it" in log


def test_a_command_that_ended_while_the_node_was_down_ends_at_its_real_time(
    node: Node,
) -> None:
    node.jobs.accept(_spec("early", ["sh", "-c", "sleep 0.5; echo done"]))
    _wait_started(node, "early")
    node.jobs.stop()  # the node goes; the command ends while it is down
    folder = next(node.outbox.jobs())
    wait_for("the keeper's exit file", lambda: folder.attempt_path(1, "exit").exists(), 20)
    real_end = json.loads(folder.attempt_path(1, "exit").read_text())["at"]
    time.sleep(1.5)  # the node comes back well after
    jobs = node.restart()
    jobs.resume()
    view = node.end("early", 20)
    assert view.end_state == "Completed"
    assert view.end_at is not None and utc_text(view.end_at) == real_end, (view.end_at, real_end)
    log = [json.loads(line) for line in (folder.path / "log.jsonl").read_text().splitlines()]
    # (The stopped Jobs may have read the exit too, as it stopped: each line says when.)
    exited = [line["t"] for line in log if line["m"].startswith("sh exited 0")]
    assert exited and set(exited) == {real_end}, "the exit line carries the real end"


def test_a_job_whose_keeper_was_killed_runs_once_more_or_ends_crashed_saying_why(
    tmp_path: Path,
) -> None:
    for rerun, expected in (((True, "the miss policy still runs it"), "Completed"),
                            ((False, "older than its grace"), "Crashed")):
        node = Node(tmp_path / expected, rerun=rerun)
        node.jobs.accept(_spec("killed", ["sleep", "30"]))
        folder = next(iter(node.outbox.jobs()))
        # Its command has started (a loaded machine takes longer than a fixed sleep).
        wait_for("the command's start", folder.attempt_path(1, "started").exists, 30)
        node.jobs.stop()
        keeper = folder.view().attempts[0]
        os.kill(keeper.shim_pid or 0, signal.SIGKILL)  # the machine went down, say
        command = json.loads(folder.attempt_path(1, "started").read_text())["pid"]
        os.killpg(command, signal.SIGKILL)
        time.sleep(0.2)
        # The second run need not sleep: the job's command is now a quick one.
        spec = json.loads((folder.path / "job.json").read_text())
        (folder.path / "job.json").write_text(json.dumps({**spec, "argv": ["true"]}))
        jobs = node.restart()
        jobs.resume()
        view = node.end("killed", 20)
        assert view.end_state == expected, view.message
        assert view.attempts[0].interrupted is not None
        if expected == "Crashed":
            assert view.message.endswith("not run again: older than its grace")
            assert len(view.attempts) == 1
        jobs.stop()


def test_a_job_journalled_as_starting_with_no_keeper_is_an_interrupted_start(
    node: Node,
) -> None:
    # The node was killed between writing "launch" and spawning the keeper.
    spec = _spec("torn", ["echo", "ran"])
    folder = node.outbox.create(spec)
    folder.append({"e": "accepted", "at": utc_text(spec.accepted_at)})
    folder.append({"e": "launch", "at": utc_text(spec.accepted_at), "attempt": 1})
    jobs = node.restart()
    jobs.resume()
    view = node.end("torn")
    assert view.end_state == "Completed" and len(view.attempts) == 2
    assert view.attempts[0].interrupted is not None


def test_a_waiting_job_waits_again_after_a_restart(node: Node) -> None:
    jobs = node.restart(slots=1)
    jobs.accept(_spec("busy", ["sleep", "0.8"], schedule="x"))
    jobs.accept(_spec("queued", ["true"]))
    jobs.stop()
    assert launcher.alive(next(iter(node.outbox.jobs())).view().attempts[0].shim_pid, None)
    jobs = node.restart(slots=1)
    found = dict(jobs.resume())
    assert found == {"busy": "taken up again", "queued": "waits for a slot again"}
    assert node.end("queued", 20).end_state == "Completed"
    assert node.end("busy", 20).end_state == "Completed"


def test_the_outbox_trims_the_oldest_unsent_output_past_its_size(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox", max_bytes=1)
    spec = _spec("chatty", ["true"])
    folder = outbox.create(spec)
    folder.append({"e": "launch", "at": utc_text(spec.accepted_at), "attempt": 1})
    lines = [json.dumps({"t": utc_text(spec.accepted_at), "m": f"line {n}"})
             for n in range(1000)]
    folder.attempt_path(1, "out").write_text("\n".join(lines) + "\n")
    folder.attempt_path(1, "exit").write_text(json.dumps({"exit_code": 0}))
    assert outbox.trim(now=spec.accepted_at, untouched=lambda f, n: False) == 0, \
        "output someone started to send is not cut"
    freed = outbox.trim(now=spec.accepted_at, untouched=lambda f, n: True)
    kept = folder.attempt_path(1, "out").read_text().splitlines()
    assert freed > 0 and len(kept) == 101
    assert "900 earlier output lines dropped" in json.loads(kept[0])["m"]
    assert json.loads(kept[-1])["m"] == "line 999"


def test_overlap_verdicts() -> None:
    running = Peer("j1", "run-1", "2026-12-04T07:30:00Z", running=True, waiting=False)
    waiting = Peer("j2", "run-2", "waiting", running=False, waiting=True)
    assert overlap_verdict("skip", "s", []) == ("run", "")
    assert overlap_verdict("allow", "s", [running]) == ("run", "")
    assert overlap_verdict("skip", "s", [running])[0] == "skip"
    assert overlap_verdict("buffer-one", "s", [running])[0] == "wait"
    assert overlap_verdict("buffer-one", "s", [running, waiting])[0] == "skip"
    assert overlap_verdict("cancel-other", "s", [running])[0] == "cancel"


def test_a_warm_keeper_waits_with_a_bare_environment_and_runs_the_job_it_is_handed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHED_TOKEN", "agent-secret-token")
    keepers = launcher.WarmKeepers(size=1)
    try:
        keepers.take()  # none ready yet: it starts filling
        deadline = time.monotonic() + 20
        while not keepers._ready and time.monotonic() < deadline:
            time.sleep(0.05)
        (ready,) = keepers._ready
        environ = Path(f"/proc/{ready.keeper.pid}/environ").read_bytes().split(b"\0")
        assert [item.split(b"=")[0] for item in environ if item] == [b"PATH"]
        outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
        folder = outbox.create(_spec("warm", ["sh", "-c", "echo $GIVEN"]))
        keeper = launcher.launch(folder, 1, argv=["sh", "-c", "echo $GIVEN"], cwd=None,
                                 umask=0o077, timeout_s=10, env={**ENV, "GIVEN": "handed over"},
                                 warm=keepers)
        assert keeper.pid == ready.keeper.pid, "the warm keeper took the job"
        assert launcher.wait(keeper)
        out = folder.attempt_path(1, "out").read_text().splitlines()
        assert [json.loads(line)["m"] for line in out] == ["handed over"]
        assert json.loads(folder.attempt_path(1, "exit").read_text())["exit_code"] == 0
    finally:
        keepers.close()
    spare = keepers._ready
    assert spare == [], "closing lets the warm keepers go"


@pytest.mark.parametrize("warm", [True, False])
def test_the_keeper_is_journalled_before_it_has_the_job_and_ends_unused_without_it(
    tmp_path: Path, warm: bool,
) -> None:
    """A node killed right after a command started used to find no keeper in its journal
    (it was journalled after the hand-over) and run the attempt a second time: the keeper
    is named (``before``) while it waits for the job; one whose hand-over fails never runs
    it."""
    keepers = launcher.WarmKeepers(size=1 if warm else 0)
    outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
    try:
        if warm:
            keepers.take()
            wait_for("a warm keeper", lambda: bool(keepers._ready), 20)
        folder = outbox.create(_spec("named", ["sh", "-c", "echo ran"]))
        seen: list[tuple[int, bool]] = []

        def before(keeper: launcher.Keeper) -> None:
            time.sleep(0.3)  # a slow journal: the command must still wait for it
            seen.append((keeper.pid, folder.attempt_path(1, "started").exists()))

        keeper = launcher.launch(folder, 1, argv=["sh", "-c", "echo ran"], cwd=None,
                                 umask=0o077, timeout_s=10, env=ENV, warm=keepers,
                                 before=before)
        assert seen == [(keeper.pid, False)], "the command started before its keeper was named"
        assert launcher.wait(keeper)
        assert folder.attempt_path(1, "started").exists()

        other = outbox.create(_spec("refused", ["sh", "-c", "echo ran"]))
        named: list[launcher.Keeper] = []

        def refuse(keeper: launcher.Keeper) -> None:
            named.append(keeper)
            raise OSError(28, "No space left on device", "journal.jsonl")

        with pytest.raises(OSError):
            launcher.launch(other, 1, argv=["sh", "-c", "echo ran"], cwd=None, umask=0o077,
                            timeout_s=10, env=ENV, warm=keepers, before=refuse)
        (unused,) = named
        assert launcher.wait(unused)  # it ends on its own: its pipe closed with no job
        assert not other.attempt_path(1, "started").exists(), "a keeper ran a job it never got"
    finally:
        keepers.close()


def test_keepers_wanted_for_an_instant_are_started_then_the_pool_goes_back_to_its_size() -> None:
    keepers = launcher.WarmKeepers(size=1)
    try:
        keepers.want(3)  # three windows start at the next instant
        wait_for("three warm keepers", lambda: len(keepers._ready) == 3, 60)
        taken = [keepers.take() for _ in range(3)]
        assert all(item is not None for item in taken)
        # Back to its size: one keeper again, not three.
        wait_for("the pool refilled to its size", lambda: len(keepers._ready) == 1, 60)
        time.sleep(1.0)
        assert len(keepers._ready) == 1
        for item in taken:
            assert item is not None
            os.close(item.handoff)
            launcher.wait(item.keeper)
    finally:
        keepers.close()
    off = launcher.WarmKeepers(size=0)
    off.want(5)  # a node without warm keepers starts none
    time.sleep(0.5)
    assert off._ready == []
