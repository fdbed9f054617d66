"""The scaled layout on one machine: Postgres, Redis, Prefect APIs + services, controllers, HAProxy.

``python scripts/scaled.py [--dir DIR] up|down|status|clean`` (``make scaled-up`` / ``make
scaled-down``; docs/scaled.md says what each part is for and what to size).

- ``up`` starts whatever part is not running, in order: the Postgres cluster (made on first
  use, under DIR/pg, with the ``prefect`` and ``sched`` databases), Redis, HAProxy, then the
  Prefect API processes, the Prefect services process and the controller instances together
  (after ``prefect server database upgrade`` and ``sched controller migrate``), and waits
  until each one answers. Run again, it starts only what is missing (a killed API process,
  a stopped Redis) and changes nothing else. It ends with where each part listens and logs.
- ``down`` stops every process ``up`` started (SIGTERM, then SIGKILL after a deadline;
  Postgres by ``pg_ctl stop -m fast``) and checks that none is left. Data stays in DIR.
- ``status`` prints each part (running or not, its address, pid and log); exit 1 unless all run.
- ``clean`` is ``down``, then deletes DIR.

Ports are chosen once, at the first ``up``, from ``SCALED_PORT_BASE`` (default 27200: below
Linux's ephemeral range, 32768-60999, where a client's connection may hold a port) or the
per-part variables below, and kept in DIR/layout.json; a later ``up`` with a different value
is refused (``clean`` first). Sizes likewise (``SCALED_DB_POOL_SIZE`` ...). Only the standard
library and what the project's venv has (Prefect, prefect-redis, redis-py) are used here; the
servers are Debian's ``postgresql``, ``redis-server`` and ``haproxy``.

Every process is recorded with its pid and its start time (``/proc/<pid>/stat``), so ``down``
never signals a process that merely reuses a recorded pid.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".scaled"
BIN = Path(sys.executable).parent  # the venv's bin: prefect, sched
START_TIMEOUT_ENV = "SCALED_START_TIMEOUT"  # seconds `up` waits for the parts to answer
STOP_GRACE_S = 20.0

# Every setting a user may give at the first `up`: (variable, default, what it is).
PORT_BASE_ENV = "SCALED_PORT_BASE"
SETTINGS: dict[str, tuple[str, str]] = {
    "SCALED_BIND": ("127.0.0.1", "address the two balancer frontends listen on"),
    "SCALED_API_COUNT": ("2", "Prefect API processes"),
    "SCALED_CONTROLLER_COUNT": ("2", "controller instances (0: none)"),
    "SCALED_DB_POOL_SIZE": ("20", "SQLAlchemy pool size of each Prefect process"),
    "SCALED_DB_MAX_OVERFLOW": ("20", "SQLAlchemy overflow of each Prefect process"),
    "SCALED_PG_MAX_CONNECTIONS": ("", "Postgres max_connections (default: computed)"),
    "SCALED_REDIS_MAXMEMORY": ("512mb", "Redis maxmemory (noeviction past it)"),
    "SCALED_LB_MAXCONN": ("10000", "HAProxy maxconn per frontend"),
    "SCALED_LB_PROCESSES": (
        "1", "HAProxy processes on the same ports (each has its own open-file limit)"),
    "SCALED_CONTROLLER_MAX_CONNECTIONS": (
        "1000", "each controller's --max-connections (a node's long poll holds one)"),
}
# Port offsets from SCALED_PORT_BASE, and the variable that sets each port alone.
PORTS: dict[str, tuple[int, str]] = {
    "prefect_lb": (0, "SCALED_PREFECT_PORT"),
    "controller_lb": (10, "SCALED_CONTROLLER_PORT"),
    "lb_stats": (20, "SCALED_STATS_PORT"),
    "postgres": (32, "SCALED_PG_PORT"),
    "redis": (79, "SCALED_REDIS_PORT"),
}
API_PORT_OFFSET = 1  # api1 = base+1, api2 = base+2, ... (SCALED_API_PORTS="a,b" sets them)
CONTROLLER_PORT_OFFSET = 11  # SCALED_CONTROLLER_PORTS likewise


class LayoutError(Exception):
    """Something the user must fix; the message says what and how."""


class MissingPrograms(LayoutError):
    """Programs the layout needs are not installed: Debian packages, or the project's own."""

    def __init__(self, debian: list[str], project: list[str]) -> None:
        self.debian, self.project = debian, project
        parts = []
        if debian:
            parts.append(
                f"missing Debian packages: {', '.join(debian)} (`make scaled-up` installs them"
                " where it may, as root; else `apt-get install postgresql postgresql-contrib"
                " redis-server haproxy`)")
        if project:
            parts.append(f"missing: {'; '.join(project)} (run `make setup`)")
        super().__init__("; ".join(parts))


_T0 = time.monotonic()


def say(text: str) -> None:
    print(f"scaled: [{time.monotonic() - _T0:5.1f} s] {text}", flush=True)


# --- processes -----------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """Return the start time of pid (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def alive(record: dict[str, int] | None) -> bool:
    """Return True if the recorded process still runs (same pid, same start time)."""
    return bool(record) and start_time(record["pid"]) == record["start"]  # type: ignore[index]


def record_of(pid: int) -> dict[str, int]:
    started = start_time(pid)
    if started is None:
        raise LayoutError(f"process {pid} exited as soon as it started")
    return {"pid": pid, "start": started}


def spawn(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> dict[str, int]:
    """Start argv detached (own session, no stdin, output appended to log); return its record."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return record_of(proc.pid)


def stop(records: dict[str, dict[str, int] | None], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the recorded processes at once, wait up to grace_s, then SIGKILL what is left."""
    running = {name: rec for name, rec in records.items() if rec is not None and alive(rec)}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for rec in running.values():
            try:
                os.kill(rec["pid"], sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while running and time.monotonic() < deadline:
            for name, rec in list(running.items()):
                if not alive(rec):
                    say(f"stopped {name} (pid {rec['pid']})")
                    del running[name]
            time.sleep(0.1)
        if running and sig == signal.SIGTERM:
            say(f"still running {grace_s:.0f} s after SIGTERM: {', '.join(running)}: SIGKILL")
    if running:
        raise LayoutError(f"survived SIGKILL: {', '.join(running)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


# --- the layout's configuration ------------------------------------------------------------


@dataclass
class Tools:
    """Where the servers' programs are; an error names the Debian package that brings each."""

    pg_bin: Path
    redis: str
    haproxy: str

    @staticmethod
    def find() -> Tools:
        debian: list[str] = []
        project: list[str] = []
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), reverse=True)
        pg_bin = candidates[0].parent if candidates else None
        if pg_bin is None:
            debian.append("postgresql")
        elif not (pg_bin.parent / "lib" / "pg_trgm.so").exists():
            debian.append(f"postgresql-contrib (pg_trgm for PostgreSQL {pg_bin.parent.name})")
        redis = shutil.which("redis-server")
        if redis is None:
            debian.append("redis-server")
        haproxy = shutil.which("haproxy") or (
            "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
        if haproxy is None:
            debian.append("haproxy")
        if os.geteuid() == 0 and pg_bin is not None:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                debian.append("postgresql (its `postgres` user, to run the server as, not root)")
        for program in ("prefect", "sched"):
            if not (BIN / program).exists():
                project.append(str(BIN / program))
        if importlib.util.find_spec("prefect_redis") is None:
            project.append(f"the prefect-redis package in {sys.executable}")
        if debian or project:
            raise MissingPrograms(debian, project)
        assert pg_bin is not None and redis is not None and haproxy is not None
        return Tools(pg_bin, redis, haproxy)


def _int(name: str, text: str, low: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LayoutError(f"{name}={text!r} is not a whole number") from None
    if value < low:
        raise LayoutError(f"{name}={text!r}: at least {low}")
    return value


def _port(name: str, text: str) -> int:
    value = _int(name, text, 1)
    if value > 65535:
        raise LayoutError(f"{name}={text!r} is not a TCP port (1-65535)")
    return value


def _port_list(name: str, text: str, count: int) -> list[int]:
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if len(parts) != count:
        raise LayoutError(f"{name}={text!r}: {count} ports wanted (comma-separated)")
    return [_port(name, p) for p in parts]


def config_from_env(env: dict[str, str]) -> dict[str, Any]:
    """Return the layout's settings and ports as the environment gives them (checked)."""
    values = {name: env.get(name, default) for name, (default, _) in SETTINGS.items()}
    base = _port(PORT_BASE_ENV, env.get(PORT_BASE_ENV, "27200"))
    apis = _int("SCALED_API_COUNT", values["SCALED_API_COUNT"], 1)
    controllers = _int("SCALED_CONTROLLER_COUNT", values["SCALED_CONTROLLER_COUNT"], 0)
    pool = _int("SCALED_DB_POOL_SIZE", values["SCALED_DB_POOL_SIZE"], 1)
    overflow = _int("SCALED_DB_MAX_OVERFLOW", values["SCALED_DB_MAX_OVERFLOW"], 0)
    ports: dict[str, Any] = {part: _port(var, env[var]) if env.get(var) else base + offset
             for part, (offset, var) in PORTS.items()}
    ports["api"] = (_port_list("SCALED_API_PORTS", env["SCALED_API_PORTS"], apis)
                    if env.get("SCALED_API_PORTS")
                    else [base + API_PORT_OFFSET + i for i in range(apis)])
    ports["controller"] = (
        _port_list("SCALED_CONTROLLER_PORTS", env["SCALED_CONTROLLER_PORTS"], controllers)
        if env.get("SCALED_CONTROLLER_PORTS")
        else [base + CONTROLLER_PORT_OFFSET + i for i in range(controllers)])
    flat = [p for v in ports.values() for p in (v if isinstance(v, list) else [v])]
    if len(set(flat)) != len(flat):
        raise LayoutError(f"two parts would share a port: {sorted(flat)}")
    # Each Prefect process (the APIs and services) may open pool + overflow connections; each
    # controller instance its API pool, its scheduler's claim connections and its listener.
    needed = (apis + 1) * (pool + overflow) + controllers * 20 + 10
    max_conn = (_int("SCALED_PG_MAX_CONNECTIONS", values["SCALED_PG_MAX_CONNECTIONS"], 20)
                if values["SCALED_PG_MAX_CONNECTIONS"] else max(100, needed))
    if max_conn < needed:
        raise LayoutError(
            f"SCALED_PG_MAX_CONNECTIONS={max_conn} is below what the layout may open ({needed}:"
            f" {apis + 1} Prefect processes x (pool {pool} + overflow {overflow}),"
            f" {controllers} controllers x 20, 10 spare)")
    return {
        "bind": values["SCALED_BIND"], "apis": apis, "controllers": controllers,
        "pool_size": pool, "max_overflow": overflow, "pg_max_connections": max_conn,
        "redis_maxmemory": values["SCALED_REDIS_MAXMEMORY"],
        "lb_maxconn": _int("SCALED_LB_MAXCONN", values["SCALED_LB_MAXCONN"], 100),
        "lb_processes": _int("SCALED_LB_PROCESSES", values["SCALED_LB_PROCESSES"], 1),
        "controller_max_connections": _int("SCALED_CONTROLLER_MAX_CONNECTIONS",
                                           values["SCALED_CONTROLLER_MAX_CONNECTIONS"], 1),
        "ports": ports,
    }


class Layout:
    """The layout in one folder: its configuration, secrets and process records."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder.resolve()
        self.file = self.dir / "layout.json"
        self.state: dict[str, Any] = (json.loads(self.file.read_text())
                                      if self.file.exists() else {})

    @property
    def exists(self) -> bool:
        return bool(self.state)

    def create(self, config: dict[str, Any]) -> None:
        self.state = {
            "config": config,
            "secrets": {"pg_prefect": secrets.token_hex(16), "pg_sched": secrets.token_hex(16),
                        "admin_token": secrets.token_urlsafe(24)},
            "processes": {},
        }
        self.save()

    def check_env(self, env: dict[str, str]) -> None:
        """Refuse an environment that asks for another layout than the one in the folder."""
        given = config_from_env(env)
        kept = self.state["config"]
        asked = {PORT_BASE_ENV, *SETTINGS, *(v for _, v in PORTS.values()),
                 "SCALED_API_PORTS", "SCALED_CONTROLLER_PORTS"} & set(env)
        if asked and given != kept:
            diff = [k for k in kept if kept[k] != given.get(k)]
            raise LayoutError(
                f"{self.dir} holds a layout made with other settings ({', '.join(diff)} differ"
                f" from {', '.join(sorted(asked))}); unset them, or run `clean` first")

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.chmod(0o600)
        tmp.replace(self.file)

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.state["config"]
        return config

    @property
    def ports(self) -> dict[str, Any]:
        ports: dict[str, Any] = self.config["ports"]
        return ports

    def proc(self, name: str) -> dict[str, int] | None:
        record: dict[str, int] | None = self.state["processes"].get(name)
        return record

    def set_proc(self, name: str, record: dict[str, int] | None) -> None:
        if record is None:
            self.state["processes"].pop(name, None)
        else:
            self.state["processes"][name] = record
        self.save()

    # paths and URLs
    def log(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"

    @property
    def prefect_url(self) -> str:
        return f"http://{self._client_host()}:{self.ports['prefect_lb']}/api"

    @property
    def controller_url(self) -> str:
        return f"http://{self._client_host()}:{self.ports['controller_lb']}"

    def _client_host(self) -> str:
        bind = str(self.config["bind"])
        return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind

    def pg_url(self, db: str, driver: str) -> str:
        password = self.state["secrets"][f"pg_{db}"]
        return f"{driver}://{db}:{password}@127.0.0.1:{self.ports['postgres']}/{db}"

    @property
    def redis_port(self) -> int:
        port: int = self.ports["redis"]
        return port

    def api_names(self) -> list[str]:
        return [f"prefect-api-{i + 1}" for i in range(self.config["apis"])]

    def controller_names(self) -> list[str]:
        return [f"controller-{i + 1}" for i in range(self.config["controllers"])]

    def lb_names(self) -> list[str]:
        """The balancer's processes: ``haproxy`` (with the stats page), ``haproxy-2``, ...

        Each binds both frontends' ports (SO_REUSEPORT, HAProxy's default on Linux: the
        kernel spreads new connections over them) and has its own open-file limit; a proxied
        connection holds two descriptors, and a node's long poll holds one connection.
        """
        count = int(self.config.get("lb_processes", 1))  # a layout made before the setting
        return ["haproxy"] + [f"haproxy-{i + 1}" for i in range(1, count)]


# --- Postgres ------------------------------------------------------------------------------


class Postgres:
    """A cluster of Debian's PostgreSQL under DIR/pg, run as the ``postgres`` user when root."""

    def __init__(self, layout: Layout, tools: Tools) -> None:
        self.layout = layout
        self.bin = tools.pg_bin
        self.data = layout.dir / "pg" / "data"
        self.run_dir = layout.dir / "pg" / "run"
        self.user = "postgres" if os.geteuid() == 0 else None
        self.port = int(layout.ports["postgres"])

    def _cmd(self, *argv: str) -> list[str]:
        if self.user:
            return ["setpriv", f"--reuid={self.user}", f"--regid={self.user}", "--init-groups",
                    "--", *argv]
        return list(argv)

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._cmd(*argv), capture_output=True, text=True, check=check,
                              cwd=self.layout.dir, stdin=subprocess.DEVNULL)

    def _chown(self, path: Path) -> None:
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._run(str(self.bin / "pg_ctl"), "status", "-D", str(self.data),
                         check=False).returncode == 0

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        if self.user:
            reach = subprocess.run(self._cmd("test", "-x", str(self.layout.dir)), check=False)
            if reach.returncode != 0:
                raise LayoutError(
                    f"the postgres user cannot reach {self.layout.dir} (a folder above it is"
                    " not searchable by others): choose another --dir, or chmod o+x its parents")
        for folder in (self.data.parent, self.run_dir):
            folder.mkdir(parents=True, exist_ok=True)
            self._chown(folder)
        self.data.parent.chmod(0o700)
        say("initdb (first start)")
        result = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                           "--auth-local=peer" if self.user else "--auth-local=trust",
                           "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                           check=False)
        if result.returncode != 0:
            raise LayoutError(f"initdb failed:\n{result.stdout}{result.stderr}")
        config = self.layout.config
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# the scaled layout (scripts/scaled.py)\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.run_dir}'\n"
                f"max_connections = {config['pg_max_connections']}\n"
                "shared_buffers = 256MB\n"
                "log_line_prefix = '%m [%p] %q%u@%d '\n"
                "log_min_duration_statement = 2000\n")

    def start(self) -> None:
        log = self.layout.log("postgres")
        if not log.exists():
            log.touch()
        self._chown(log)
        result = self._run(str(self.bin / "pg_ctl"), "start", "-w", "-t", "120", "-D",
                           str(self.data), "-l", str(log), check=False)
        if result.returncode != 0:
            raise LayoutError(f"PostgreSQL did not start (port {self.port}):\n{tail(log)}")

    def psql(self, sql: str, db: str = "postgres") -> str:
        result = self._run(str(self.bin / "psql"), "-X", "-q", "-t", "-A", "-v",
                           "ON_ERROR_STOP=1", "-h", str(self.run_dir), "-p", str(self.port),
                           "-U", "postgres", "-d", db, "-c", sql, check=False)
        if result.returncode != 0:
            raise LayoutError(f"psql failed ({sql[:60]}...): {result.stderr.strip()}")
        return result.stdout.strip()

    def ensure_databases(self) -> None:
        for db in ("prefect", "sched"):
            password = self.layout.state["secrets"][f"pg_{db}"]
            if not self.psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{db}'"):
                self.psql(f"CREATE ROLE {db} LOGIN PASSWORD '{password}'")
            if not self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'"):
                self.psql(f"CREATE DATABASE {db} OWNER {db}")

    def stop(self) -> None:
        if not self.running():
            return
        pid = self.pid()
        result = self._run(str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m",
                           "fast", "-w", "-t", "60", check=False)
        if result.returncode != 0:
            raise LayoutError(f"pg_ctl stop failed: {result.stderr.strip()}")
        # pg_ctl returns once the pid file is gone, a moment before the process itself.
        deadline = time.monotonic() + 30
        while pid is not None and start_time(pid) is not None:
            if time.monotonic() > deadline:
                raise LayoutError(f"postgres (pid {pid}) still runs after pg_ctl stop")
            time.sleep(0.05)
        say(f"stopped postgres (pid {pid})")


# --- Redis and HAProxy configuration -------------------------------------------------------


def redis_conf(layout: Layout) -> Path:
    folder = layout.dir / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "redis.conf"
    conf.write_text(
        "# the scaled layout (scripts/scaled.py): Prefect's messages, cache, leases, docket\n"
        "bind 127.0.0.1\n"
        f"port {layout.redis_port}\n"
        "protected-mode yes\n"
        "daemonize no\n"
        f"dir {folder}\n"
        f"logfile {layout.log('redis')}\n"
        # Kept across a restart: the event streams and their consumer groups, leases, docket's
        # queues. fsync every second: a crash of the machine loses at most the last second.
        "appendonly yes\n"
        "appendfsync everysec\n"
        'save ""\n'
        f"maxmemory {layout.config['redis_maxmemory']}\n"
        # Never evict a stream or a lease silently: past maxmemory, writes fail (and say so).
        "maxmemory-policy noeviction\n")
    return conf


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


CHECK_TIMEOUT_S = 15
"""How long HAProxy waits for a server's health answer (its ``timeout check``)."""


def _balanced(name: str, bind: str, maxconn: object, health: str,
              servers: list[tuple[str, int]], hold_s: int | None = None) -> str:
    """One HAProxy frontend and its backend: least connections, servers checked on health.

    ``hold_s``: how long an answer may take (the defaults' 120 s otherwise). A health check
    may take :data:`CHECK_TIMEOUT_S` to be answered: a dead process (connection refused)
    is still out after two checks (~4 s), but one busy for less is not taken out. With the check's
    own 2 s, both API processes of a 10,000-node fleet's peak were marked down in turn and
    HAProxy answered 503 itself (``<NOSRV>``), ~1,600 in 3 minutes.
    """
    lines = "\n".join(f"    server {server} 127.0.0.1:{port} check" for server, port in servers)
    client = f"\n    timeout client {hold_s}s" if hold_s else ""
    server = f"\n    timeout server {hold_s}s" if hold_s else ""
    return f"""
frontend {name}
    bind {bind}
    maxconn {maxconn}{client}
    default_backend {name}_api

backend {name}_api
    balance leastconn{server}
    option httpchk GET {health}
    http-check expect status 200
    timeout check {CHECK_TIMEOUT_S}s
    default-server inter 2s fall 2 rise 2
{lines}
"""


def haproxy_conf(layout: Layout, name: str = "haproxy") -> Path:
    """The configuration of the balancer's process name (``Layout.lb_names``): the same
    frontends for each; the first also serves the stats page, and each has its own socket."""
    folder = layout.dir / "haproxy"
    folder.mkdir(parents=True, exist_ok=True)
    ports, bind, maxconn = layout.ports, layout.config["bind"], layout.config["lb_maxconn"]
    prefect_part = _balanced("prefect", f"{bind}:{ports['prefect_lb']}", maxconn, "/api/health",
                             list(zip(layout.api_names(), ports["api"], strict=True)))
    controllers = list(zip(layout.controller_names(), ports["controller"], strict=True))
    # A node's long poll is held up to 300 s (a heartbeat that long): 30 s more to answer.
    controller_part = _balanced("controller", f"{bind}:{ports['controller_lb']}", maxconn,
                                "/healthz", controllers, hold_s=330) if controllers else ""
    first = name == "haproxy"
    stats = "" if not first else f"""
frontend stats
    bind 127.0.0.1:{ports['lb_stats']}
    stats enable
    stats uri /
    stats refresh 5s
"""
    conf = folder / ("haproxy.cfg" if first else f"{name}.cfg")
    conf.write_text(f"""# the scaled layout (scripts/scaled.py); see docs/scaled.md
global
    log stderr format raw local0 info
    stats socket {haproxy_socket(layout, name)} mode 600 level admin

defaults
    mode http
    log global
    option httplog
    option dontlog-normal
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    # event streams (websockets /api/events/in and /out) stay open for hours
    timeout tunnel 1h
    timeout client-fin 5s
    timeout http-keep-alive 60s
    # a connection refused (a dead API process) is retried on another server; a request
    # already sent is never retried here (Prefect's client retries it, with its own keys)
    retries 3
    option redispatch 1
    retry-on conn-failure
{prefect_part}{controller_part}{stats}""")
    return conf


def haproxy_socket(layout: Layout, name: str = "haproxy") -> Path:
    return layout.dir / "haproxy" / ("admin.sock" if name == "haproxy" else f"{name}.sock")


def haproxy_stats(layout: Layout, name: str = "haproxy") -> dict[str, dict[str, str]]:
    """Return the ``show stat`` rows of the balancer's process name for its servers, by
    ``backend/server`` ({} if none)."""
    path = str(haproxy_socket(layout, name))
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(path)
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return {}
    lines = data.decode(errors="replace").splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    head = lines[0][2:].split(",")
    rows: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        row = dict(zip(head, line.split(","), strict=False))
        if row.get("svname") not in ("FRONTEND", "BACKEND", None):
            rows[f"{row['pxname']}/{row['svname']}"] = row
    return rows


def haproxy_servers(layout: Layout, name: str = "haproxy") -> dict[str, str]:
    """Return {backend/server: status (UP, DOWN, ...)} as the health checks of the balancer's
    process name see them."""
    return {server: row.get("status", "") for server, row in haproxy_stats(layout, name).items()}


# --- Prefect and the controller ------------------------------------------------------------


def base_env(layout: Layout, home: Path) -> dict[str, str]:
    """The environment of a process we start: ours, less any Prefect or sched setting."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "SCHED_", "SCALED_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"PREFECT_HOME": str(home), "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


def prefect_server_env(layout: Layout, home: Path) -> dict[str, str]:
    """The settings Prefect's "How to scale self-hosted Prefect" guide gives every server process.

    Every name was checked against Prefect 3.9.1 and prefect-redis 0.3.0 (docs/scaled.md).
    """
    redis = f"redis://127.0.0.1:{layout.redis_port}"
    env = base_env(layout, home)
    env.update({
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": layout.pg_url("prefect", "postgresql+asyncpg"),
        "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": str(layout.config["pool_size"]),
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": str(layout.config["max_overflow"]),
        # prefect-redis's broker, but an event's deduplication key and its stream entry are
        # written by one script: in two steps, a Redis restart or a dead API process between
        # them made the client's retry of the event look like a duplicate, and it was lost.
        "PREFECT_MESSAGING_BROKER": "deployments.redis_messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_HOST": "127.0.0.1",
        "PREFECT_REDIS_MESSAGING_PORT": str(layout.redis_port),
        "PREFECT_REDIS_MESSAGING_DB": "0",
        # An API process holds the events it reads off a client's websocket in a batch of 5 (or
        # 10 s) before it writes them to Redis: a process killed in between loses them, after the
        # client has already counted them as delivered. One by one, there is nothing to lose.
        "PREFECT_REDIS_MESSAGING_PUBLISHER_BATCH_SIZE": "1",
        # Not in the guide: the worker channel's cleanup queue is per process by default.
        "PREFECT_SERVER_WORKER_CHANNEL_CLEANUP_QUEUE_STORAGE": "prefect_redis.cleanup_queue",
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_HOST": "127.0.0.1",
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PORT": str(layout.redis_port),
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_DB": "0",
        "PREFECT_SERVER_DOCKET_URL": f"{redis}/1",
        # As `make run`: the services process deletes runs and events older than 7 days.
        "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": str(7 * 24 * 3600),
        "PREFECT_UI_API_URL": layout.prefect_url,
    })
    return env


def controller_env(layout: Layout) -> dict[str, str]:
    env = base_env(layout, layout.dir / "prefect" / "controller-client")
    env.update({"SCHED_DATABASE_URL": layout.pg_url("sched", "postgresql"),
                "SCHED_TOKENS_FILE": str(tokens_file(layout)),
                "PREFECT_API_URL": layout.prefect_url})
    return env


def tokens_file(layout: Layout) -> Path:
    path = layout.dir / "controller" / "tokens.toml"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(f'admin = ["{layout.state["secrets"]["admin_token"]}"]\n[nodes]\n')
        tmp.replace(path)
    return path


def run_tool(argv: list[str], env: dict[str, str], what: str, log: Path) -> None:
    """Run a one-shot command (a migration), its output appended to log; raise naming it."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, check=False, timeout=600)
    if result.returncode != 0:
        raise LayoutError(f"{what} failed (exit {result.returncode}):\n{tail(log)}")


def services_ready(layout: Layout, record: dict[str, int] | None) -> bool:
    """The services process is ready once its docket worker has registered in Redis.

    (Its event consumers cannot be seen before an event reaches them: Redis 7.0 lists a stream
    consumer only once something was delivered to it.) Docket keeps ``<host>#<pid>`` in a
    ``<docket>:workers`` set in the docket database (db 1).
    """
    if not alive(record):
        return False
    assert record is not None
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=layout.redis_port, db=1, socket_timeout=2,
                             decode_responses=True)
        with client:
            for key in client.scan_iter(match="*:workers", count=1000):
                if client.type(key) == "zset" and any(
                        str(m).endswith(f"#{record['pid']}") for m in client.zrange(key, 0, -1)):
                    return True
    except Exception:  # Redis restarting: not ready yet
        return False
    return False


# --- up, down, status ----------------------------------------------------------------------


@dataclass
class Part:
    """A process of the layout we start and watch: how to start it and when it is ready."""

    name: str
    start: Callable[[], dict[str, int]]
    ready: Callable[[], bool]
    where: str


def parts(layout: Layout) -> tuple[list[Part], list[Part]]:
    """Return (the Prefect processes, the controller instances) as parts to start."""
    prefect = BIN / "prefect"
    prefect_parts = []
    for i, (name, port) in enumerate(zip(layout.api_names(), layout.ports["api"], strict=True)):
        def start_api(name: str = name, port: int = port, first: bool = i == 0) -> dict[str, int]:
            env = prefect_server_env(layout, layout.dir / "prefect" / name)
            # Block types are registered by the first API process only: two processes doing it
            # at once on a new database collide (unique violations, logged as ~40 ERRORs).
            env["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] = "true" if first else "false"
            return spawn([str(prefect), "server", "start", "--host", "127.0.0.1", "--port",
                          str(port), "--no-services", "--keep-alive-timeout", "75"],
                         env, layout.log(name), layout.dir)
        prefect_parts.append(Part(
            name, start_api, partial(http_ok, f"http://127.0.0.1:{port}/api/health"),
            f"http://127.0.0.1:{port}/api"))

    def start_services() -> dict[str, int]:
        env = prefect_server_env(layout, layout.dir / "prefect" / "services")
        return spawn([str(prefect), "server", "services", "start"], env,
                     layout.log("prefect-services"), layout.dir)
    prefect_parts.append(Part(
        "prefect-services", start_services,
        lambda: services_ready(layout, layout.proc("prefect-services")),
        f"(no port; consumes Redis 127.0.0.1:{layout.redis_port})"))

    controller_parts = []
    for name, port in zip(layout.controller_names(), layout.ports["controller"], strict=True):
        def start_controller(name: str = name, port: int = port) -> dict[str, int]:
            # A layout made before the setting existed has no value: the controller's default.
            ceiling = layout.config.get("controller_max_connections", 1000)
            return spawn([str(BIN / "sched"), "controller", "serve", "--host", "127.0.0.1",
                          "--port", str(port), "--max-connections", str(ceiling)],
                         controller_env(layout), layout.log(name), layout.dir / "controller")
        controller_parts.append(Part(
            name, start_controller, partial(http_ok, f"http://127.0.0.1:{port}/healthz"),
            f"http://127.0.0.1:{port}"))
    return prefect_parts, controller_parts


def wait_ready(layout: Layout, waiting: list[Part], timeout: float) -> None:
    """Wait until every part is ready; raise naming the first that died or is still not ready."""
    deadline = time.monotonic() + timeout
    pending = list(waiting)
    while pending:
        for part in list(pending):
            if part.ready():
                pending.remove(part)
                continue
            record = layout.proc(part.name)
            if record is not None and not alive(record):
                raise LayoutError(f"{part.name} exited while starting; the end of its log"
                                  f" ({layout.log(part.name)}):\n{tail(layout.log(part.name))}")
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise LayoutError(f"not ready after {timeout:.0f} s: {names}; see their logs in"
                              f" {layout.dir / 'logs'}")
        if pending:
            time.sleep(0.3)


def up(layout: Layout) -> None:
    began = time.monotonic()
    tools = Tools.find()
    env = dict(os.environ)
    timeout = float(_int(START_TIMEOUT_ENV, env.get(START_TIMEOUT_ENV, "240"), 1))
    if layout.exists:
        layout.check_env(env)
    else:
        config = config_from_env(env)
        taken = [f"{part} {port}" for part, port in _all_ports(config)
                 if not port_free(port)]
        if taken:
            raise LayoutError(
                f"ports in use: {', '.join(taken)}; set {PORT_BASE_ENV} (default 27200) or the"
                " per-part variable (docs/scaled.md) to free ones")
        layout.create(config)
    (layout.dir / "logs").mkdir(parents=True, exist_ok=True)
    started: list[str] = []

    pg = Postgres(layout, tools)
    if not pg.running():
        pg.init()
        pg.start()
        started.append("postgres")
    pg.ensure_databases()

    if not alive(layout.proc("redis")):
        conf = redis_conf(layout)
        layout.set_proc("redis", spawn([tools.redis, str(conf)], base_env(layout, layout.dir),
                                       layout.dir / "redis" / "stdout.log", layout.dir))
        started.append("redis")
    deadline = time.monotonic() + 60
    while not redis_ping(layout.redis_port):
        if not alive(layout.proc("redis")) or time.monotonic() > deadline:
            raise LayoutError(f"Redis did not answer on {layout.redis_port}:\n"
                              f"{tail(layout.log('redis'))}")
        time.sleep(0.1)

    for lb in layout.lb_names():
        if alive(layout.proc(lb)):
            continue
        conf = haproxy_conf(layout, lb)
        check = subprocess.run([tools.haproxy, "-c", "-q", "-f", str(conf)], capture_output=True,
                               text=True, check=False)
        if check.returncode != 0:
            raise LayoutError(f"haproxy refused {conf}: {check.stdout}{check.stderr}")
        layout.set_proc(lb, spawn([tools.haproxy, "-db", "-f", str(conf)],
                                  base_env(layout, layout.dir), layout.log(lb), layout.dir))
        started.append(lb)
        deadline = time.monotonic() + 30
        while not haproxy_servers(layout, lb):
            if not alive(layout.proc(lb)) or time.monotonic() > deadline:
                raise LayoutError(f"HAProxy ({lb}) did not start:\n{tail(layout.log(lb))}")
            time.sleep(0.1)

    prefect_parts, controller_parts = parts(layout)
    to_start = [p for p in prefect_parts if not alive(layout.proc(p.name))]
    if to_start:
        say("prefect server database upgrade")
        run_tool([str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
                 prefect_server_env(layout, layout.dir / "prefect" / "migrate"),
                 "prefect server database upgrade", layout.log("migrations"))
    controllers_to_start = [p for p in controller_parts if not alive(layout.proc(p.name))]
    if controllers_to_start:
        say("sched controller migrate")
        run_tool([str(BIN / "sched"), "controller", "migrate"], controller_env(layout),
                 "sched controller migrate", layout.log("migrations"))
    for part in to_start + controllers_to_start:
        layout.set_proc(part.name, part.start())
        started.append(part.name)
    if to_start or controllers_to_start:
        say(f"started {', '.join(p.name for p in to_start + controllers_to_start)}; waiting")
    wait_ready(layout, prefect_parts + controller_parts, timeout)
    # Through the balancer: every API process UP in HAProxy's checks, and /api/health answers.
    deadline = time.monotonic() + 60
    want = {f"prefect_api/{n}" for n in layout.api_names()} | {
        f"controller_api/{n}" for n in layout.controller_names()}
    while True:
        seen = {lb: haproxy_servers(layout, lb) for lb in layout.lb_names()}
        if (all(servers.get(s) == "UP" for servers in seen.values() for s in want)
                and http_ok(f"{layout.prefect_url}/health")):
            break
        if time.monotonic() > deadline:
            raise LayoutError(f"HAProxy does not see every server UP: {seen}; see"
                              f" {', '.join(str(layout.log(lb)) for lb in seen)}")
        time.sleep(0.3)
    write_client_env(layout)
    elapsed = time.monotonic() - began
    say(f"up in {elapsed:.1f} s; started: {', '.join(started) or 'nothing (all were running)'}")
    status(layout)


def _all_ports(config: dict[str, Any]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for part, value in config["ports"].items():
        for i, port in enumerate(value if isinstance(value, list) else [value]):
            out.append((f"{part}{i + 1}" if isinstance(value, list) else part, port))
    return out


def write_client_env(layout: Layout) -> Path:
    path = layout.dir / "client.env"
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(
        "# source this file: a node's or an operator's view of the scaled layout\n"
        f"export PREFECT_API_URL={layout.prefect_url}\n"
        f"export SCHED_CONTROLLER_URL={layout.controller_url}\n"
        f"export SCHED_TOKEN={layout.state['secrets']['admin_token']}\n")
    tmp.replace(path)
    return path


def down(layout: Layout) -> None:
    if not layout.exists:
        say(f"nothing to stop: no layout in {layout.dir}")
        return
    tools = Tools.find()
    # The balancer first (no new requests), then the Prefect processes and controllers
    # together, then what they use.
    groups = [layout.lb_names(),
              [*layout.controller_names(), *layout.api_names(), "prefect-services"], ["redis"]]
    names = [n for group in groups for n in group]
    for group in groups:
        stop({name: layout.proc(name) for name in group})
        for name in group:
            layout.set_proc(name, None)
    pg = Postgres(layout, tools)
    pg.stop()
    left = [n for n in names if alive(layout.proc(n))] + (["postgres"] if pg.running() else [])
    if left:
        raise LayoutError(f"still running: {', '.join(left)}")
    say(f"down: nothing of the layout in {layout.dir} runs (its data stays; `clean` deletes it)")


def status(layout: Layout) -> bool:
    if not layout.exists:
        say(f"no layout in {layout.dir} (run `up`)")
        return False
    tools = Tools.find()
    pg = Postgres(layout, tools)
    prefect_parts, controller_parts = parts(layout)
    lb = haproxy_servers(layout)
    rows: list[tuple[str, bool, str, str, str]] = []
    pg_pid = pg.pid() if pg.running() else None
    rows.append(("postgres", pg_pid is not None,
                 f"127.0.0.1:{layout.ports['postgres']} (db prefect, sched)",
                 str(pg_pid or "-"), str(layout.log("postgres"))))
    redis_rec = layout.proc("redis")
    rows.append(("redis", alive(redis_rec) and redis_ping(layout.redis_port),
                 f"127.0.0.1:{layout.redis_port}", str((redis_rec or {}).get("pid", "-")),
                 str(layout.log("redis"))))
    for lb_name in layout.lb_names():
        lb_rec = layout.proc(lb_name)
        stats_page = (f", http://127.0.0.1:{layout.ports['lb_stats']}/ (stats)"
                      if lb_name == "haproxy" else " (same ports)")
        rows.append((lb_name, alive(lb_rec),
                     f"{layout.prefect_url} (Prefect), {layout.controller_url} (controller)"
                     f"{stats_page}", str((lb_rec or {}).get("pid", "-")),
                     str(layout.log(lb_name))))
    for part in prefect_parts + controller_parts:
        rec = layout.proc(part.name)
        backend = "prefect_api" if part in prefect_parts else "controller_api"
        seen = lb.get(f"{backend}/{part.name}")
        where = part.where + (f" [balancer: {seen}]" if seen else "")
        rows.append((part.name, alive(rec) and part.ready(), where,
                     str((rec or {}).get("pid", "-")), str(layout.log(part.name))))
    width = max(len(r[0]) for r in rows)
    for name, ok, where, pid, log in rows:
        print(f"  {name:<{width}}  {'running' if ok else 'DOWN':<7}  pid {pid:<7}  {where}")
        print(f"  {'':<{width}}  log {log}")
    print(f"  clients: source {layout.dir / 'client.env'} (PREFECT_API_URL, SCHED_CONTROLLER_URL,"
          " SCHED_TOKEN)")
    return all(r[1] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", choices=["up", "down", "status", "clean"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("SCALED_DIR",
                                                                          DEFAULT_DIR)),
                        help="the layout's folder (default .scaled/ in the checkout)")
    args = parser.parse_args(argv)
    layout = Layout(args.dir)
    try:
        if args.command == "up":
            up(layout)
        elif args.command == "down":
            down(layout)
        elif args.command == "status":
            return 0 if status(layout) else 1
        else:
            down(layout)
            shutil.rmtree(layout.dir, ignore_errors=True)
            say(f"deleted {layout.dir}")
    except LayoutError as exc:
        print(f"scaled: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
