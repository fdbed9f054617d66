"""``make run``: a local Prefect server on SQLite, and the example agent served against it.

1. Start ``prefect server start`` with ``PREFECT_HOME`` under the project
   (``.prefect/``, git-ignored), its log in ``.prefect/server.log``, and the
   database vacuum on so the runs' history does not grow without bound.
2. Wait until ``/api/health`` answers.
3. Start the node (``python -m flows.node``) with ``SCHED_CONFIG`` (default:
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
from pathlib import Path
from types import FrameType

import httpx

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
        "PREFECT_LOGGING_EXTRA_LOGGERS": "sched_core,flows",
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
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
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
        [sys.executable, "-m", "flows.node"],
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


def main() -> int:
    """Run the server and the agent until interrupted; return the exit status."""
    port = int(os.environ.get("SCHED_PREFECT_PORT", "4200"))
    home = ROOT / ".prefect"
    home.mkdir(exist_ok=True)
    env = server_env(home, port)
    api = env["PREFECT_API_URL"]
    if not port_free(port):
        print(f"port {port} is in use (another Prefect server?); stop it or set "
              "SCHED_PREFECT_PORT", file=sys.stderr)
        return 2
    prefect_cli = str(Path(sys.executable).parent / "prefect")
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    status = 0
    try:
        print(f"starting a Prefect server on 127.0.0.1:{port} (PREFECT_HOME={home}, "
              f"log {home / 'server.log'})...", flush=True)
        server = start_server(prefect_cli, port, env, home)
        if not wait_healthy(api, server, timeout_s=120):
            print(f"the Prefect server did not become healthy; see {home / 'server.log'}",
                  file=sys.stderr)
            return 1
        print(f"starting the node with SCHED_CONFIG={env['SCHED_CONFIG']}...", flush=True)
        agent = start_agent(env)
        print(
            f"\n  Prefect UI: http://127.0.0.1:{port}/\n"
            "  The node fires its own windows and records each job here: its coming windows\n"
            "  are Scheduled runs of run-job/demo (Deployments > run-job/demo > Upcoming);\n"
            "  each runs at its time, and the chain's prune and check follow the wave.\n"
            "  Press Ctrl-C to stop everything.\n",
            flush=True,
        )
        backoff = {"server": RESTART_MIN_S, "agent": RESTART_MIN_S}
        while not stopping:
            if server.poll() is not None:
                say(f"the Prefect server exited (code {server.returncode}); starting it again "
                    f"in {backoff['server']:.0f} s", err=True)
                if pause(backoff["server"], lambda: stopping):
                    break
                backoff["server"] = min(backoff["server"] * 2, RESTART_MAX_S)
                server = start_server(prefect_cli, port, env, home)
                if wait_healthy(api, server, timeout_s=120):
                    backoff["server"] = RESTART_MIN_S
            if agent.poll() == 2:  # its settings are invalid: starting again cannot help
                say("the agent refused its settings (above); stopping", err=True)
                status = 2
                break
            if agent.poll() is not None:
                say(f"the node exited (code {agent.returncode}); starting it again "
                    f"in {backoff['agent']:.0f} s", err=True)
                if pause(backoff["agent"], lambda: stopping):
                    break
                backoff["agent"] = min(backoff["agent"] * 2, RESTART_MAX_S)
                agent = start_agent(env)
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(agent, "the node", grace_s=30)
        stop(server, "the Prefect server", grace_s=20)
        say("stopped.")
    return status


if __name__ == "__main__":
    sys.exit(main())
