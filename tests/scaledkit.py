"""What the tests of the scaled layout (scripts/scaled.py) share: one throwaway layout on free
ports in a temporary folder (``layout``), run by the checkout's script, and its clients (each
with the layout's secrets: Prefect's auth string, Redis's password)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.scaled_parts import config as scaled_config
from scripts.scaled_parts.balancer import haproxy_stats
from scripts.scaled_parts.config import Tools
from scripts.scaled_parts.procs import MissingPrograms, alive

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "scaled.py"
DEADLINE_S = 180.0  # generous: the machine may be loaded; nothing asserts on a duration


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait(what: str, condition: Callable[[], bool], timeout: float = DEADLINE_S,
         explain: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what} {explain()}".rstrip())
        time.sleep(0.25)


class Layout:
    """The layout the test started: the script's view of it, and how to run the script."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env

    def script(self, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--dir", str(self.folder), command], env=self.env,
            capture_output=True, text=True, timeout=600, check=False, stdin=subprocess.DEVNULL)

    @property
    def state(self) -> Any:
        return scaled_config.Layout(self.folder)

    def pid(self, name: str) -> int:
        pid: int = self.state.proc(name)["pid"]
        return pid

    def servers(self) -> dict[str, dict[str, str]]:
        stats: dict[str, dict[str, str]] = haproxy_stats(self.state)
        return stats

    @property
    def auth(self) -> httpx.BasicAuth:
        """Prefect's auth string (``name:secret``) as HTTP Basic, as Prefect's client sends it."""
        user, password = self.state.secret("prefect_auth").split(":", 1)
        return httpx.BasicAuth(user, password)

    def prefect(self, api: str | None = None) -> httpx.Client:
        """A client of Prefect's API (the balancer's, or api) with the auth string."""
        return httpx.Client(base_url=api or self.state.prefect_url, timeout=30, auth=self.auth)

    def redis(self) -> Any:
        """A client of the layout's Redis (database 0), with its password."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.state.redis_port, decode_responses=True,
                           password=self.state.secret("redis"))


def readable_by_others(folder: Path) -> list[str]:
    """Every file under folder that its group or others may read or write, and every folder
    they may list or write in (search alone is allowed: as root, the postgres user passes)."""
    found = []
    for root, _dirs, files in os.walk(folder):
        for path in [Path(root), *(Path(root) / f for f in files)]:
            try:
                info = path.lstat()
            except FileNotFoundError:  # a server's temporary file
                continue
            mode = stat.S_IMODE(info.st_mode)
            if ((stat.S_ISREG(info.st_mode) and mode & 0o077)
                    or (stat.S_ISDIR(info.st_mode) and mode & 0o066)):
                found.append(f"{path.relative_to(folder)} {mode:o}")
    return found


@pytest.fixture(name="layout")
def scaled_layout() -> Iterator[Layout]:
    """The layout, up: two API processes, two controllers, two HAProxy processes."""
    try:
        Tools.find()
    except MissingPrograms as exc:
        if exc.project:
            raise
        pytest.skip(str(exc))
    # Not pytest's tmp_path: as root, Postgres runs as `postgres`, which must reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="sched-scaled-"))
    folder.chmod(0o755)
    names = ["SCALED_PREFECT_PORT", "SCALED_CONTROLLER_PORT", "SCALED_STATS_PORT",
             "SCALED_PG_PORT", "SCALED_REDIS_PORT"]
    ports = free_ports(len(names) + 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SCHED_",
                                                                    "SCALED_"))}
    env.update({name: str(port) for name, port in zip(names, ports, strict=False)})
    env.update({"SCALED_API_PORTS": f"{ports[-4]},{ports[-3]}",
                "SCALED_CONTROLLER_PORTS": f"{ports[-2]},{ports[-1]}",
                "SCALED_DB_POOL_SIZE": "5", "SCALED_DB_MAX_OVERFLOW": "10",
                "SCALED_LB_PROCESSES": "2"})
    handle = Layout(folder, env)
    try:
        started = handle.script("up")
        assert started.returncode == 0, f"up failed:\n{started.stdout}\n{started.stderr}"
        yield handle
    finally:
        stopped = handle.script("down")
        if stopped.returncode != 0:  # never leave a server behind, whatever happened
            for record in (handle.state.state.get("processes") or {}).values():
                if alive(record):
                    os.kill(record["pid"], signal.SIGKILL)
            pg = folder / "pg" / "data" / "postmaster.pid"
            if pg.exists():
                os.kill(int(pg.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
