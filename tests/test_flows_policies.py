"""Row policies (issue 12) in the agent's flows, against a real Prefect server.

The planner applies jitter, pauses and blackouts to the runs it creates and
deletes; the start guard skips what they rule out, naming the policy; the
overlap policy is tried with real concurrent jobs whose commands write their
start and end times; the repository lock with two nodes (two configurations,
two state folders, two processes) on one repository.

Pinned instants: 2026-12-02 is a Wednesday; New York is on EST (UTC-5).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.test_flows import EVERY_HOUR_AT_30, T0, WINDOW, Agent, cache_rows, row, scheduled

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Agent:
    return Agent(tmp_path, monkeypatch)

ROOT = Path(__file__).resolve().parent.parent
PY = json.dumps(sys.executable)

# A job that appends "<schedule> <trigger> start|end <unix time>" to a file. In
# between it waits for the gate file ``go-<trigger>`` beside it (at most 20 s),
# then 1 s more: a test holds jobs running as long as it needs, without sleeps.
TIMED = (
    "import os, sys, time\n"
    "path, sid, trigger = sys.argv[1:4]\n"
    "gate = os.path.join(os.path.dirname(path), 'go-' + trigger)\n"
    "def note(what):\n"
    "    with open(path, 'a') as f:\n"
    "        f.write('%s %s %s %r\\n' % (sid, trigger, what, time.time()))\n"
    "note('start')\n"
    "deadline = time.time() + 20\n"
    "while not os.path.exists(gate) and time.time() < deadline:\n"
    "    time.sleep(0.05)\n"
    "time.sleep(1)\n"
    "note('end')\n"
)


def open_gate(log: Path, trigger: str) -> None:
    (log.parent / f"go-{trigger}").touch()


def timed_action(log: Path, name: str = "slow") -> str:
    return (f"[actions.{name}]\n"
            f"argv = [{PY}, \"-c\", {json.dumps(TIMED)}, {json.dumps(str(log))}, "
            f"\"{{schedule_id}}\", \"{{trigger_key}}\"]\n"
            "timeout = 60\n")


def intervals(log: Path) -> dict[tuple[str, str], tuple[float, float | None]]:
    """Return (schedule, trigger) -> (start, end or None) from the jobs' time file."""
    found: dict[tuple[str, str], list[float | None]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        sid, trigger, what, when = line.split()
        item = found.setdefault((sid, trigger), [None, None])
        item[0 if what == "start" else 1] = float(when)
    return {key: (value[0] or 0.0, value[1]) for key, value in found.items()}


def wait_for(predicate: Any, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def overlapping(a: tuple[float, float | None], b: tuple[float, float | None]) -> bool:
    assert a[1] is not None and b[1] is not None
    return a[0] < b[1] and b[0] < a[1]


def artifact_text(agent: Agent, key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return str(max(artifacts, key=lambda artifact: artifact.created).data)


# -- the planner and the guard -----------------------------------------------------------


def test_the_planner_jitters_pauses_and_blacks_out_and_the_artifact_says_so(
    agent: Agent,
) -> None:
    from flows.job import run_job
    from flows.reconcile import reconcile
    from sched_core.policies import duration_text, jitter_offset

    every_30 = {"days": None, "hours": None, "minute": "", "interval_minutes": 30}
    agent.write_schedules([
        {**row("j", "backup", EVERY_HOUR_AT_30), "jitter": 900},
        {**row("p", "copy", EVERY_HOUR_AT_30),
         "paused": {"note": "disk | swap", "until": "2026-12-02T17:30:00Z"}},
        {**row("b", "prune", every_30),
         "blackouts": [{"days": ["wed"], "from": "11:00", "to": "12:00"}]},
    ])
    agent.register()
    counts = reconcile(now=T0)  # 10:29:05 EST
    runs = {(run.parameters["schedule_id"], run.parameters["window"]):
            run.expected_start_time.astimezone(UTC) for run in scheduled(agent)}
    offset = timedelta(seconds=jitter_offset(agent.node, "j", 900))
    j = sorted(start - datetime.fromisoformat(window)
               for (sid, window), start in runs.items() if sid == "j")
    assert j == [offset] * 3  # 15:30, 16:30, 17:30, each at its window plus the node's offset
    assert sorted(w for sid, w in runs if sid == "p") == [  # 11:30 and 12:00 are paused
        "2026-12-02T17:30:00+00:00", "2026-12-02T18:30:00+00:00", "2026-12-02T19:30:00+00:00"]
    assert sorted(w for sid, w in runs if sid == "b") == [  # 11:00 and 11:30 are dark
        "2026-12-02T15:30:00+00:00", "2026-12-02T17:00:00+00:00", "2026-12-02T17:30:00+00:00"]
    assert counts["created"] == 9
    text = artifact_text(agent, f"reconcile-{agent.node}")
    assert r"paused: disk \| swap (until 2026-12-02 12:30 EST)" in text  # the note escaped
    assert f"jitter 900 s (this node: +{duration_text(offset)})" in text
    assert "blackout wed 11:00-12:00" in text
    starts = (WINDOW + offset).astimezone(ZoneInfo("America/New_York"))
    assert f"Wed 2026-12-02 10:30 EST (starts {starts:%H:%M:%S})" in text
    assert "Wed 2026-12-02 11:00 EST skipped: in the blackout wed 11:00-12:00" in text

    # A new pause deletes j's untried runs, saying why; a run that starts anyway skips.
    agent.write_schedules([
        {**row("j", "backup", EVERY_HOUR_AT_30), "jitter": 900,
         "paused": {"note": "repository moved"}},
    ])
    counts = reconcile(now=T0 + timedelta(minutes=1))
    assert counts["deleted"] == 3 + 3 + 3 and scheduled(agent) == []
    assert "schedule j skips this window: paused: repository moved (until resumed)" in (
        artifact_text(agent, f"reconcile-{agent.node}"))
    state = run_job(schedule_id="j", trigger_key="schedule", window=WINDOW, key="j@x",
                    now=WINDOW + offset, return_state=True)
    assert state.name == "Skipped"
    assert state.message == ("window 2026-12-02 10:30 EST skipped: paused: repository moved "
                             "(until resumed)")


def test_a_new_jitter_moves_the_untried_runs_once(agent: Agent) -> None:
    from flows.reconcile import reconcile
    from sched_core.policies import jitter_offset

    agent.write_schedules([row("j", "backup", EVERY_HOUR_AT_30)])
    agent.register()
    assert reconcile(now=T0)["created"] == 3
    agent.write_schedules([{**row("j", "backup", EVERY_HOUR_AT_30), "jitter": 900}])
    assert reconcile(now=T0 + timedelta(minutes=1))["moved"] == 3
    offset = timedelta(seconds=jitter_offset(agent.node, "j", 900))
    runs = scheduled(agent)
    assert [run.state.state_details.scheduled_time.astimezone(UTC)
            - datetime.fromisoformat(run.parameters["window"]) for run in runs] == [offset] * 3
    assert [run.next_scheduled_start_time.astimezone(UTC)
            - datetime.fromisoformat(run.parameters["window"]) for run in runs] == [offset] * 3
    again = reconcile(now=T0 + timedelta(minutes=2))
    assert again["moved"] == 0 and again["created"] == 0


def test_a_jittered_run_is_late_only_a_grace_after_its_own_start(agent: Agent) -> None:
    from flows.job import run_job
    from sched_core.policies import jitter_offset

    cache_rows(agent, [{**row("j", "backup", EVERY_HOUR_AT_30), "jitter": 3600,
                        "miss_policy": "skip"}])
    start = WINDOW + timedelta(seconds=jitter_offset(agent.node, "j", 3600))
    late = run_job(schedule_id="j", trigger_key="schedule", window=WINDOW, key="j@1",
                   now=start + timedelta(minutes=5, seconds=1), return_state=True)
    assert late.name == "Skipped" and "5 min 1 s late (grace 5 min); miss policy skip" in (
        late.message)
    on_time = run_job(schedule_id="j", trigger_key="schedule", window=WINDOW, key="j@1",
                      now=start + timedelta(minutes=5), return_state=True)
    assert on_time.name == "Completed"


# -- overlap -----------------------------------------------------------------------------

W2 = WINDOW + timedelta(hours=1)


def overlap_agent(agent: Agent, tmp: Path, mode: str | None) -> Path:
    log = tmp / "times.log"
    agent.write_config(extra=timed_action(log))
    overlap = {"overlap": mode} if mode else {}
    cache_rows(agent, [{**row("o", "slow", EVERY_HOUR_AT_30), **overlap}])
    return log


def start_job(window: datetime, states: list[Any], trigger: str = "schedule") -> threading.Thread:
    from flows.job import run_job

    def go() -> None:
        states.append(run_job(schedule_id="o", trigger_key=trigger, window=window,
                              key=f"o@{window:%H%M}", now=window + timedelta(seconds=1),
                              return_state=True))

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_overlap_skip_ends_the_new_run_without_running_it(agent: Agent, tmp_path: Path) -> None:
    """The default: the 10:30 backup still runs at 11:30; the 11:30 run ends Skipped."""
    from flows.job import run_job

    log = overlap_agent(agent, tmp_path, None)
    first: list[Any] = []
    thread = start_job(WINDOW, first)
    wait_for(lambda: ("o", "schedule") in intervals(log), what="the first job's start")
    state = run_job(schedule_id="o", trigger_key="schedule", window=W2, key="o@2",
                    now=W2 + timedelta(seconds=1), return_state=True)
    open_gate(log, "schedule")
    thread.join(60)
    assert state.name == "Skipped"
    assert state.message.startswith(
        "a job of schedule o is still active on this node: run slow-o-20261202T1530Z (")
    assert state.message.endswith("); overlap skip")
    assert first[0].name == "Completed"
    assert list(intervals(log)) == [("o", "schedule")]  # one command ran
    # Once the first has ended, the slot is free again.
    open_gate(log, "manual")
    assert run_job(schedule_id="o", trigger_key="manual", return_state=True).name == "Completed"


def test_overlap_allow_runs_both_at_once(agent: Agent, tmp_path: Path) -> None:
    log = overlap_agent(agent, tmp_path, "allow")
    states: list[Any] = []
    threads = [start_job(WINDOW, states)]
    wait_for(lambda: ("o", "schedule") in intervals(log), what="the first job's start")
    threads.append(start_job(W2, states, trigger="schedule-recovery"))
    wait_for(lambda: ("o", "schedule-recovery") in intervals(log), what="the second job")
    open_gate(log, "schedule")
    open_gate(log, "schedule-recovery")
    for thread in threads:
        thread.join(60)
    assert [state.name for state in states] == ["Completed", "Completed"]
    times = intervals(log)
    assert overlapping(times[("o", "schedule")], times[("o", "schedule-recovery")])


def test_overlap_buffer_one_runs_one_waiter_after_and_skips_the_next(
    agent: Agent, tmp_path: Path
) -> None:
    from flows.job import run_job

    log = overlap_agent(agent, tmp_path, "buffer-one")
    states: list[Any] = []
    first = start_job(WINDOW, states)
    wait_for(lambda: ("o", "schedule") in intervals(log), what="the first job's start")
    waiter = start_job(W2, states, trigger="schedule-recovery")
    wait_for(lambda: (tmp_path / "state" / "jobs" / "o.wait").exists(), what="the waiter")
    time.sleep(0.3)  # the waiter holds the wait slot once it has opened it
    third = run_job(schedule_id="o", trigger_key="manual", return_state=True)
    assert list(intervals(log)) == [("o", "schedule")]  # the waiter still waits
    open_gate(log, "schedule")
    open_gate(log, "schedule-recovery")
    first.join(60)
    waiter.join(60)
    assert third.name == "Skipped"
    assert third.message.endswith("and another run already waits for it; overlap buffer-one")
    assert sorted(state.name for state in states) == ["Completed", "Completed"]
    times = intervals(log)
    ran_first, ran_after = times[("o", "schedule")], times[("o", "schedule-recovery")]
    assert ran_first[1] is not None and ran_after[0] >= ran_first[1]
    assert ("o", "manual") not in times


def test_overlap_cancel_other_cancels_the_active_run_through_its_runner(
    agent: Agent, tmp_path: Path, prefect_server: str
) -> None:
    """The active job runs under `serve` (its runner stops it when Prefect says so)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from flows.job import run_job

    log = overlap_agent(agent, tmp_path, "cancel-other")
    open_gate(log, "manual")  # the new run's command ends at once; the old one's never would
    served = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        # prefect.serve of a deployment, as deployments/serve.py does: its runs
        # start with `python -m prefect.engine` (Flow.serve would cloudpickle
        # run_job by value, and its annotations would not resolve).
        [sys.executable, "-c", "from prefect import serve; from flows.job import run_job; "
         f"serve(run_job.to_deployment(name={agent.node!r}))"],
        cwd=ROOT, env=child_env(agent.config, prefect_server, tmp_path),
        stdout=served, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with get_client(sync_client=True) as client:
            deployment = None

            def registered() -> bool:
                nonlocal deployment
                try:
                    deployment = client.read_deployment_by_name(f"run-job/{agent.node}")
                except Exception:
                    return False
                return True

            wait_for(registered, what="serve to register run-job")
            assert deployment is not None
            active = client.create_flow_run_from_deployment(
                deployment.id, parameters={"schedule_id": "o", "trigger_key": "long"},
                state=Scheduled(scheduled_time=datetime.now(UTC)),
            )
            wait_for(lambda: ("o", "long") in intervals(log), 90, "the served job's start")
            state = run_job(schedule_id="o", trigger_key="manual", return_state=True)
            assert state.name == "Completed"
            wait_for(lambda: client.read_flow_run(active.id).state.is_final(), 30,
                     "the cancelled run to end")
            old = client.read_flow_run(active.id)
            history = client.read_flow_run_states(active.id)
        assert old.state is not None and old.state.is_cancelled()
        [asked] = [item for item in history if item.name == "Cancelling"]
        assert asked.message is not None and asked.message.startswith("cancelled by ")
        assert asked.message.endswith("overlap cancel-other of schedule o")
        times = intervals(log)
        assert times[("o", "long")][1] is None  # stopped before its end
        # Its command was stopped with it, before the new one started.
        wait_for(lambda: not commands_of(log, "long"), 15, "the old command to stop")
        assert old.start_time is not None
        assert times[("o", "manual")][0] > old.start_time.timestamp()
    finally:
        stop(serve)
        served.close()
    assert not commands_of(log, "long")


def commands_of(log: Path, trigger: str) -> list[int]:
    """Return the pids of the timed commands of trigger writing to log that still run."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(log).encode() in argv and trigger.encode() in argv:
            found.append(int(entry.name))
    return found


def child_env(config: Path, api_url: str, tmp: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHED_")}
    env.update({
        "SCHED_CONFIG": str(config), "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
    })
    return env


def stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- repo_lock ---------------------------------------------------------------------------

TWO_JOBS = (
    "import sys, threading\n"
    "from flows.job import run_job\n"
    "states = []\n"
    "def go(sid): states.append(run_job(schedule_id=sid, return_state=True).name)\n"
    "threads = [threading.Thread(target=go, args=(sid,)) for sid in sys.argv[1:]]\n"
    "[t.start() for t in threads]\n"
    "[t.join() for t in threads]\n"
    "print('STATES', sorted(states))\n"
)


def test_repo_lock_keeps_two_nodes_jobs_on_one_repository_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_server: str
) -> None:
    """Two nodes, two jobs each, all at once on repository r-lock: never two at a time.

    On each node two other schedules of the same repository without the lock
    run at once, which shows the time file does catch an overlap.
    """
    log = tmp_path / "times.log"
    nodes = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        node = Agent(folder, monkeypatch)
        node.write_config(extra=timed_action(log))
        open_gate(log, "manual")
        cache_rows(node, [
            {**row(f"{name}-1", "slow", EVERY_HOUR_AT_30), "repo_id": "r-lock",
             "repo_lock": True},
            {**row(f"{name}-2", "slow", EVERY_HOUR_AT_30), "repo_id": "r-lock",
             "repo_lock": True},
            {**row(f"{name}-free-1", "slow", EVERY_HOUR_AT_30), "repo_id": "r-lock"},
            {**row(f"{name}-free-2", "slow", EVERY_HOUR_AT_30), "repo_id": "r-lock"},
        ])
        nodes.append((name, node))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_JOBS, f"{name}-1", f"{name}-2"],
            cwd=ROOT, env=child_env(node.config, prefect_server, tmp_path),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        for name, node in nodes
    ]
    try:
        outputs = [proc.communicate(timeout=180)[0].decode() for proc in procs]
    finally:
        for proc in procs:
            stop(proc)
    for output in outputs:
        assert "STATES ['Completed', 'Completed']" in output, output[-3000:]
    times = intervals(log)
    locked = [times[(sid, "manual")] for sid in ("a-1", "a-2", "b-1", "b-2")]
    for index, first in enumerate(locked):
        for second in locked[index + 1:]:
            assert not overlapping(first, second), (first, second)

    # The control: the same time file shows two unlocked jobs running at once.
    from flows.job import run_job

    monkeypatch.setenv("SCHED_CONFIG", str(nodes[0][1].config))
    free: list[str] = []
    threads = [threading.Thread(target=lambda sid=sid: free.append(
        run_job(schedule_id=sid, trigger_key="free", return_state=True).name))
        for sid in ("a-free-1", "a-free-2")]
    for thread in threads:
        thread.start()
    wait_for(lambda: {("a-free-1", "free"), ("a-free-2", "free")} <= set(intervals(log)),
             what="both unlocked jobs to start")
    open_gate(log, "free")
    for thread in threads:
        thread.join(60)
    assert free == ["Completed", "Completed"]
    times = intervals(log)
    assert overlapping(times[("a-free-1", "free")], times[("a-free-2", "free")])


def test_a_job_says_what_repository_lock_it_waits_for(agent: Agent, tmp_path: Path) -> None:
    from flows.job import run_job
    from tests.test_flows import _logs

    log = tmp_path / "times.log"
    open_gate(log, "manual")
    agent.write_config(extra=timed_action(log))
    cache_rows(agent, [{**row("l", "slow", EVERY_HOUR_AT_30), "repo_id": "r-said",
                        "repo_lock": True}])
    state = run_job(schedule_id="l", return_state=True)
    assert state.name == "Completed"
    lines = _logs(state.state_details.flow_run_id, "holding the repository lock")
    assert any(line.startswith("waiting for the repository lock sched-repo-r-said: jobs of "
                               "repository r-said run one at a time across the fleet")
               for line in lines)
    assert any(line.startswith("holding the repository lock sched-repo-r-said (waited ")
               for line in lines)
