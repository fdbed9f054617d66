"""The scaled layout's secrets and files (issue 36, points 9 and 13), one server at a time.

Redis started from the layout's configuration refuses a client without its password, and
HAProxy's stats page one without its own; the Prefect processes and the controllers get
Prefect's auth string and Redis's password in their environment (a command line would show
them to anyone through ``ps``); what the layout and the servers it starts write is their
owner's alone (0600 files, 0700 folders), and ``up`` makes a file made before private again.
tests/test_scaled_layout.py checks the same on the whole layout, running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from scripts.scaled_parts.balancer import haproxy_conf, redis_conf, redis_ping
from scripts.scaled_parts.config import SECRETS, Layout, config_from_env, make_private
from scripts.scaled_parts.procs import LayoutError, alive, record_of, spawn, stop
from scripts.scaled_parts.services import controller_env, prefect_server_env
from tests.scaledkit import free_ports, wait
from tests.test_private_files import shell_umask  # noqa: F401  (the fixture)

# The layout starts its servers detached and follows them by pid (``spawn``), so Python's
# handle of each is dropped while the server runs, which it warns about.
# Every test under the usual umask of 022 (files 0644), whatever the test process was given.
pytestmark = [pytest.mark.filterwarnings("ignore:subprocess .* is still running:ResourceWarning"),
              pytest.mark.usefixtures("shell_umask")]


@pytest.fixture
def layout() -> Iterator[Layout]:
    """A layout's folder and settings on free ports; nothing started. Not pytest's tmp_path:
    under it, HAProxy's socket path is over its 97 characters."""
    prefect, stats, redis = free_ports(3)
    folder = Path(tempfile.mkdtemp(prefix="sched-s-"))
    made = Layout(folder / "scaled")
    made.create(config_from_env({"SCALED_PREFECT_PORT": str(prefect),
                                 "SCALED_STATS_PORT": str(stats),
                                 "SCALED_REDIS_PORT": str(redis), "SCALED_CONTROLLER_COUNT": "0"}))
    (made.dir / "logs").mkdir()
    try:
        yield made
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _server(program: str, argv: list[str], layout: Layout, name: str
            ) -> Iterator[dict[str, int]]:
    """Run program (argv after it) as the layout runs its servers, until the test ends."""
    path = shutil.which(program) or (f"/usr/sbin/{program}"
                                     if Path(f"/usr/sbin/{program}").exists() else None)
    if path is None:
        pytest.skip(f"{program} is not installed (scripts/system-packages.sh)")
    record = spawn([path, *argv], {"PATH": os.environ["PATH"]}, layout.log(name), layout.dir)
    try:
        yield record
    finally:
        stop({name: record}, grace_s=10)
        assert not alive(record)


def _send(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return sock.recv(200)


def test_a_layouts_secrets_are_made_once_and_kept_in_its_owners_file(layout: Layout) -> None:
    assert _mode(layout.file) == 0o600
    kept = json.loads(layout.file.read_text())["secrets"]
    assert set(kept) == set(SECRETS) >= {"prefect_auth", "redis", "lb_stats"}
    assert kept["prefect_auth"].startswith("sched:")  # name:secret (docs/agent.md)
    assert len(set(kept.values())) == len(kept)
    assert Layout(layout.dir).state["secrets"] == kept  # read back, not made again
    # A layout made before they existed: named, and given them by `up` (scripts/scaled.py).
    del layout.state["secrets"]["redis"], layout.state["secrets"]["lb_stats"]
    assert layout.missing_secrets() == ["redis", "lb_stats"]
    with pytest.raises(LayoutError, match=r"'redis'.*`down`, then `up`"):
        redis_conf(layout)


def test_a_tampered_secret_never_reaches_a_configuration_file(layout: Layout) -> None:
    # Each goes into redis.conf, haproxy.cfg, a URL or SQL: only its own shape is taken.
    layout.state["secrets"]["redis"] = "x\nrename-command CONFIG \"\""
    layout.state["secrets"]["lb_stats"] = "0" * 32 + "\n    stats admin if TRUE"
    with pytest.raises(LayoutError, match="'redis' is malformed"):
        redis_conf(layout)
    with pytest.raises(LayoutError, match="'lb_stats' is malformed"):
        haproxy_conf(layout)
    assert not (layout.dir / "redis" / "redis.conf").exists()


def _until_up(what: str, up: Callable[[], bool], record: dict[str, int], log: Path) -> None:
    """Wait until up() (the server answers); fail with its log as soon as it has exited."""
    wait(what, lambda: up() or not alive(record), timeout=60, explain=log.read_text)
    assert alive(record), f"exited: {log.read_text()}"


@pytest.fixture
def redis_server(layout: Layout) -> Iterator[dict[str, int]]:
    yield from _server("redis-server", [str(redis_conf(layout))], layout, "redis")


def test_redis_refuses_a_client_without_its_password(
        layout: Layout, redis_server: dict[str, int]) -> None:
    password = layout.secret("redis")
    _until_up("Redis answers", lambda: redis_ping(layout.redis_port, password), redis_server,
              layout.log("redis"))
    assert _mode(layout.dir / "redis" / "redis.conf") == 0o600
    assert _send(layout.redis_port, b"PING\r\n").startswith(b"-NOAUTH")
    assert not redis_ping(layout.redis_port, "0" * 48)
    # The services' readiness check, as `up` uses it, with the password.
    import redis

    with redis.Redis(host="127.0.0.1", port=layout.redis_port) as anyone:
        with pytest.raises(redis.AuthenticationError):
            anyone.set("k", "v")


@pytest.fixture
def haproxy(layout: Layout) -> Iterator[dict[str, int]]:
    yield from _server("haproxy", ["-db", "-f", str(haproxy_conf(layout))], layout, "haproxy")


def test_haproxys_stats_page_asks_for_its_password(
        layout: Layout, haproxy: dict[str, int]) -> None:
    page = f"http://127.0.0.1:{layout.ports['lb_stats']}/"

    def answers() -> bool:
        try:
            return httpx.get(page, timeout=5).status_code > 0
        except httpx.TransportError:
            return False

    _until_up("the stats page answers", answers, haproxy, layout.log("haproxy"))
    assert _mode(layout.dir / "haproxy" / "haproxy.cfg") == 0o600
    assert httpx.get(page, timeout=10).status_code == 401
    assert httpx.get(page, timeout=10, auth=("admin", "0" * 32)).status_code == 401
    shown = httpx.get(page, timeout=10, auth=("admin", layout.secret("lb_stats")))
    assert shown.status_code == 200 and "prefect_api" in shown.text


def test_the_servers_get_the_secrets_in_their_environment(layout: Layout) -> None:
    auth, password = layout.secret("prefect_auth"), layout.secret("redis")
    server = prefect_server_env(layout, layout.dir / "prefect" / "x")
    assert server["PREFECT_SERVER_API_AUTH_STRING"] == auth
    assert server["PREFECT_REDIS_MESSAGING_PASSWORD"] == password
    assert server["PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PASSWORD"] == password
    assert server["PREFECT_SERVER_DOCKET_URL"] == (
        f"redis://:{password}@127.0.0.1:{layout.redis_port}/1")
    controller = controller_env(layout)
    assert controller["PREFECT_API_AUTH_STRING"] == auth
    assert "PREFECT_SERVER_API_AUTH_STRING" not in controller
    assert password not in json.dumps(controller)  # the controllers never talk to Redis


def test_what_a_server_writes_is_its_owners_alone(layout: Layout) -> None:
    log = layout.log("writer")
    record = spawn(["/bin/sh", "-c", "echo made > made.txt; mkdir made.d; echo said"],
                   {"PATH": os.environ["PATH"]}, log, layout.dir)
    wait("the writer is done", lambda: not alive(record), timeout=60)
    assert log.read_text() == "said\n"
    assert {name: _mode(layout.dir / name) for name in ("made.txt", "made.d")} == {
        "made.txt": 0o600, "made.d": 0o700}
    assert _mode(log) == 0o600


def test_files_made_before_are_made_private(tmp_path: Path) -> None:
    top = tmp_path / "scaled"
    for folder in ("logs", "redis/appendonlydir", "pg/data"):
        (top / folder).mkdir(parents=True, mode=0o755)
    for file in ("layout.json", "logs/redis.log", "redis/appendonlydir/a.aof", "pg/data/x"):
        (top / file).write_text("")
        (top / file).chmod(0o644)
    (top / "logs" / "run.sh").write_text("")
    (top / "logs" / "run.sh").chmod(0o755)
    outside = tmp_path / "outside"
    outside.write_text("")
    (top / "logs" / "link").symlink_to(outside)
    changed = make_private(top, searchable={top}, skip={top / "pg"})
    assert {str(p.relative_to(top)): _mode(p) for p in changed} == {
        ".": 0o711, "logs": 0o700, "redis": 0o700, "redis/appendonlydir": 0o700,
        "layout.json": 0o600, "logs/redis.log": 0o600, "redis/appendonlydir/a.aof": 0o600,
        "logs/run.sh": 0o700}
    assert _mode(outside) == 0o644  # a link is not followed
    assert _mode(top / "pg" / "data" / "x") == 0o644  # PostgreSQL's own (initdb's modes)
    assert make_private(top, searchable={top}, skip={top / "pg"}) == []


def test_an_old_layout_gets_its_secrets_only_once_nothing_of_it_runs(layout: Layout) -> None:
    from scripts.scaled import _settle_secrets

    del layout.state["secrets"]["prefect_auth"]
    layout.set_proc("redis", record_of(os.getpid()))  # something of it runs (saved)
    with pytest.raises(LayoutError, match=r"prefect_auth.*redis run without them"):
        _settle_secrets(layout)
    assert "prefect_auth" not in Layout(layout.dir).state["secrets"]
    layout.set_proc("redis", None)
    _settle_secrets(layout)
    assert Layout(layout.dir).secret("prefect_auth") == layout.secret("prefect_auth")


def test_client_env_and_admin_env_hold_the_secrets_for_their_owner(layout: Layout) -> None:
    from scripts.scaled import write_client_env

    client, admin = write_client_env(layout)
    assert (_mode(client), _mode(admin)) == (0o600, 0o600)
    assert f"export PREFECT_API_AUTH_STRING={layout.secret('prefect_auth')}\n" in (
        client.read_text())
    assert layout.secret("redis") not in client.read_text()  # a node never needs it
    assert f"export REDISCLI_AUTH={layout.secret('redis')}\n" in admin.read_text()
    assert f"export SCALED_STATS_AUTH=admin:{layout.secret('lb_stats')}\n" in admin.read_text()
