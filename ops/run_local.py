"""``make run``: a local Prefect server on SQLite, and the example agent served against it.

1. Start ``prefect server start`` with ``PREFECT_HOME`` under the project
   (``.prefect/``, git-ignored), its log in ``.prefect/server.log``, and the
   database vacuum on so the runs' history does not grow without bound.
2. Wait until ``/api/health`` answers.
3. Start the node (``python -m sched_node``) with ``SCHED_CONFIG`` (default:
   ``examples/agent.toml``) and print the UI address.
4. Keep both running: a child that exits is started again (5 s later,
   doubling to 60 s while it keeps exiting), so a crashed server or node
   resumes by itself; the node itself fires its windows whether the server
   answers or not, and records them when it does.
5. On Ctrl-C (or SIGTERM) stop the node first (running jobs finish in their
   keeper processes, and the next start records them), then the server; each
   gets a grace period, then its process is killed.

Environment: ``SCHED_PREFECT_PORT`` (default 4200), ``SCHED_CONFIG``,
``SCHED_VACUUM_RETENTION`` (seconds of flow-run history kept, default 7 days).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from sched_node.registration import SERVER_SETTINGS

ROOT = Path(__file__).resolve().parent.parent


def server_env(home: Path, port: int) -> dict[str, str]:
    """Return the environment of the server, the serve process and its flow runs."""
    env = dict(os.environ)
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": env.get(
            "SCHED_VACUUM_RETENTION", str(7 * 24 * 3600)
        ),
        # The node's and the flows' lines go to a flow run's logs when Prefect's engine runs
        # them; the node's own lines, outside any run, stay on its console without a warning.
        "PREFECT_LOGGING_EXTRA_LOGGERS": "sched_core,sched_node,flows",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        **SERVER_SETTINGS,  # the node's deployments Ready between its polls
    })
    env.setdefault("SCHED_CONFIG", str(ROOT / "examples" / "agent.toml"))
    return env


def port_free(port: int) -> bool:
    """Return True when nothing listens on 127.0.0.1:port."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Poll url/health until it answers 200, the process exits, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def say(message: str, *, err: bool = False) -> None:
    """Print, ignoring a closed terminal or pipe (``make run | tee`` after Ctrl-C)."""
    try:
        print(message, file=sys.stderr if err else sys.stdout, flush=True)
    except OSError:
        pass


def stop(proc: subprocess.Popen[bytes] | None, name: str, grace_s: float) -> None:
    """SIGTERM proc's process group, wait up to grace_s, then SIGKILL the group.

    A node's job keepers run in sessions of their own: they are not in its group,
    and finish their commands (the next start of the node records them).
    """
    if proc is None or proc.poll() is not None:
        return
    say(f"stopping {name} (pid {proc.pid})...")
    stop_group(proc, grace_s)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float, *, kill_wait_s: float = 5.0) -> None:
    """SIGTERM proc's process group and wait up to grace_s; then SIGKILL it and wait up to
    kill_wait_s. The one process-group stop (the benchmarks use it too)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        break


RESTART_MIN_S = 5.0
RESTART_MAX_S = 60.0


def start_server(
    prefect_cli: str, port: int, env: dict[str, str], home: Path
) -> subprocess.Popen[bytes]:
    """Start the Prefect server in its own process group, its output to server.log."""
    with (home / "server.log").open("ab") as log:
        return subprocess.Popen(
            [prefect_cli, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )


def start_agent(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the node in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "sched_node"],
        env=env, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
    )


def pause(seconds: float, stopping: Callable[[], bool]) -> bool:
    """Sleep up to seconds; return True at once when stopping becomes true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stopping():
            return True
        time.sleep(0.2)
    return stopping()


@dataclass
class _Children:
    """The Prefect server and the node this run keeps going, and how to start each again."""

    prefect_cli: str
    port: int
    env: dict[str, str]
    home: Path
    server: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    stopping: bool = False
    backoff: dict[str, float] = field(
        default_factory=lambda: {"server": RESTART_MIN_S, "agent": RESTART_MIN_S})

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Ask the run to stop (step 5)."""
        self.stopping = True

    def start(self) -> bool:
        """Start the server, wait until it is healthy, start the node (steps 1-3); False
        when the server never became healthy."""
        print(f"starting a Prefect server on 127.0.0.1:{self.port} (PREFECT_HOME={self.home}, "
              f"log {self.home / 'server.log'})...", flush=True)
        self.server = start_server(self.prefect_cli, self.port, self.env, self.home)
        if not wait_healthy(self.env["PREFECT_API_URL"], self.server, timeout_s=120):
            print(f"the Prefect server did not become healthy; see {self.home / 'server.log'}",
                  file=sys.stderr)
            return False
        print(f"starting the node with SCHED_CONFIG={self.env['SCHED_CONFIG']}...", flush=True)
        self.agent = start_agent(self.env)
        print(
            f"\n  Prefect UI: http://127.0.0.1:{self.port}/\n"
            "  The node fires its own windows and records each job here: its coming windows\n"
            "  are Scheduled runs of run-job/demo (Deployments > run-job/demo > Upcoming);\n"
            "  each runs at its time, and the chain's prune and check follow the wave.\n"
            "  Press Ctrl-C to stop everything.\n",
            flush=True,
        )
        return True

    def keep(self) -> int:
        """Start again a child that exited, until asked to stop (step 4); return the exit
        status: 2 when the node refused its settings, else 0."""
        assert self.server is not None and self.agent is not None
        while not self.stopping:
            if self.server.poll() is not None:
                say(f"the Prefect server exited (code {self.server.returncode}); starting it "
                    f"again in {self.backoff['server']:.0f} s", err=True)
                if self._pause("server"):
                    break
                self.server = start_server(self.prefect_cli, self.port, self.env, self.home)
                if wait_healthy(self.env["PREFECT_API_URL"], self.server, timeout_s=120):
                    self.backoff["server"] = RESTART_MIN_S
            if self.agent.poll() == 2:  # its settings are invalid: starting again cannot help
                say("the agent refused its settings (above); stopping", err=True)
                return 2
            if self.agent.poll() is not None:
                say(f"the node exited (code {self.agent.returncode}); starting it again "
                    f"in {self.backoff['agent']:.0f} s", err=True)
                if self._pause("agent"):
                    break
                self.agent = start_agent(self.env)
            time.sleep(0.5)
        return 0

    def _pause(self, child: str) -> bool:
        """Wait the child's back-off before starting it again, then double it; True when the
        run is to stop instead."""
        if pause(self.backoff[child], lambda: self.stopping):
            return True
        self.backoff[child] = min(self.backoff[child] * 2, RESTART_MAX_S)
        return False


def main() -> int:
    """Run the server and the agent until interrupted; return the exit status."""
    port = int(os.environ.get("SCHED_PREFECT_PORT", "4200"))
    home = ROOT / ".prefect"
    home.mkdir(exist_ok=True)
    env = server_env(home, port)
    if not port_free(port):
        print(f"port {port} is in use (another Prefect server?); stop it or set "
              "SCHED_PREFECT_PORT", file=sys.stderr)
        return 2
    children = _Children(str(Path(sys.executable).parent / "prefect"), port, env, home)
    signal.signal(signal.SIGINT, children.on_signal)
    signal.signal(signal.SIGTERM, children.on_signal)
    try:
        return children.keep() if children.start() else 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(children.agent, "the node", grace_s=30)
        stop(children.server, "the Prefect server", grace_s=20)
        say("stopped.")


if __name__ == "__main__":
    sys.exit(main())
