"""The scaled layout's settings and folder: programs, ports and sizes, layout.json."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pwd
import re
import resource
import secrets
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.scaled_parts.procs import LayoutError, MissingPrograms

ROOT = Path(__file__).resolve().parents[2]  # the checkout
DEFAULT_DIR = ROOT / ".scaled"
BIN = Path(sys.executable).parent  # the venv's bin: prefect, sched
START_TIMEOUT_ENV = "SCALED_START_TIMEOUT"  # seconds `up` waits for the parts to answer

# Every setting a user may give at the first `up`: (variable, default, what it is).
PORT_BASE_ENV = "SCALED_PORT_BASE"
SETTINGS: dict[str, tuple[str, str]] = {
    "SCALED_FLEET": ("1000", "nodes the layout is to carry: sizes the three settings below it"),
    "SCALED_BIND": ("127.0.0.1", "address the two balancer frontends listen on"),
    "SCALED_API_COUNT": ("2", "Prefect API processes"),
    "SCALED_CONTROLLER_COUNT": ("2", "controller instances (0: none)"),
    "SCALED_DB_POOL_SIZE": ("20", "SQLAlchemy pool size of each Prefect process"),
    "SCALED_DB_MAX_OVERFLOW": ("20", "SQLAlchemy overflow of each Prefect process"),
    "SCALED_PG_MAX_CONNECTIONS": ("", "Postgres max_connections (default: computed)"),
    "SCALED_REDIS_MAXMEMORY": ("512mb", "Redis maxmemory (noeviction past it)"),
    "SCALED_LB_MAXCONN": ("", "HAProxy maxconn per frontend (default: from the fleet)"),
    "SCALED_LB_PROCESSES": (
        "", "HAProxy processes on the same ports, each with its own open-file limit "
        "(default: from the fleet)"),
    "SCALED_CONTROLLER_MAX_CONNECTIONS": (
        "", "each controller's --max-connections; a node's long poll holds one (default: "
        "from the fleet)"),
}
SIZED = ("lb_maxconn", "lb_processes", "controller_max_connections", "fleet")
"""The settings the fleet size derives: changed at an ``up`` after ``down``, data kept."""


def sized_for(fleet: int, open_files: int) -> dict[str, int]:
    """Return the connection settings that carry fleet nodes, open_files a process's limit.

    Each node holds one long poll at a controller, through HAProxy; when one instance
    is gone the other holds them all, so each instance's ceiling is the whole fleet and
    1,000 more for pulls, reports and people (never below ``serve``'s 4,000). Each
    frontend takes the fleet and 2,000 more (never below 10,000); a proxied connection
    is two descriptors, so HAProxy runs as many processes as keep each within 90 % of
    its open-file limit.
    """
    frontend = max(10_000, fleet + 2_000)
    return {
        "fleet": fleet,
        "controller_max_connections": max(4_000, fleet + 1_000),
        "lb_maxconn": frontend,
        "lb_processes": max(1, math.ceil(2 * (fleet + 2_000) / (0.9 * open_files))),
    }


def open_file_limit() -> int:
    """Return the hard open-file limit the layout's processes get (HAProxy raises to it)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)
# Port offsets from SCALED_PORT_BASE, and the variable that sets each port alone.
PORTS: dict[str, tuple[int, str]] = {
    "prefect_lb": (0, "SCALED_PREFECT_PORT"),
    "controller_lb": (10, "SCALED_CONTROLLER_PORT"),
    "lb_stats": (20, "SCALED_STATS_PORT"),
    "postgres": (32, "SCALED_PG_PORT"),
    "redis": (79, "SCALED_REDIS_PORT"),
}
# The layout's secrets, made once, at the first `up` (or the first after this list grew), and
# kept in layout.json: how each is made, and the shape it must have when read back (each goes
# into a configuration file, a URL or SQL: anything else in layout.json is refused).
_HEX = re.compile(r"[0-9a-f]{32,64}")
SECRETS: dict[str, tuple[Callable[[], str], re.Pattern[str]]] = {
    "pg_prefect": (lambda: secrets.token_hex(16), _HEX),
    "pg_sched": (lambda: secrets.token_hex(16), _HEX),
    "admin_token": (lambda: secrets.token_urlsafe(24), re.compile(r"[A-Za-z0-9_-]{32,64}")),
    # Prefect's auth string (HTTP Basic): `name:secret`, as docs/agent.md advises.
    "prefect_auth": (lambda: f"sched:{secrets.token_hex(24)}", re.compile(r"sched:[0-9a-f]{48}")),
    "redis": (lambda: secrets.token_hex(24), _HEX),
    "lb_stats": (lambda: secrets.token_hex(16), _HEX),  # HAProxy's stats page, user `admin`
}
LB_STATS_USER = "admin"


def write_private(path: Path, text: str) -> Path:
    """Write text to path, readable by its owner only (0600), whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)
    return path


def make_private(folder: Path, *, searchable: set[Path], skip: set[Path]) -> list[Path]:
    """Take group and other permissions off every file and folder under folder; return those
    changed.

    The folders in searchable keep others' search (x) permission only: as root, the
    ``postgres`` user passes through them. Nothing under skip is touched (the PostgreSQL
    cluster: initdb makes it 0700 and 0600 itself, owned by ``postgres``), nor anything that
    is neither a regular file nor a folder; symbolic links are not followed.
    """
    changed = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs[:] = [d for d in dirs if here / d not in skip]
        for path in [here, *(here / f for f in files)]:
            try:
                info = path.lstat()
            except FileNotFoundError:  # a server's temporary file, gone since
                continue
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                continue
            mode = stat.S_IMODE(info.st_mode)
            wanted = (mode & 0o700) | (0o011 if path in searchable else 0)
            if mode != wanted:
                path.chmod(wanted)
                changed.append(path)
    return changed


API_PORT_OFFSET = 1  # api1 = base+1, api2 = base+2, ... (SCALED_API_PORTS="a,b" sets them)
CONTROLLER_PORT_OFFSET = 11  # SCALED_CONTROLLER_PORTS likewise


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


def int_setting(name: str, text: str, low: int = 0) -> int:
    """Return the whole number a setting names, at least low (LayoutError naming it else)."""
    try:
        value = int(text)
    except ValueError:
        raise LayoutError(f"{name}={text!r} is not a whole number") from None
    if value < low:
        raise LayoutError(f"{name}={text!r}: at least {low}")
    return value


def _port(name: str, text: str) -> int:
    value = int_setting(name, text, 1)
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
    apis = int_setting("SCALED_API_COUNT", values["SCALED_API_COUNT"], 1)
    controllers = int_setting("SCALED_CONTROLLER_COUNT", values["SCALED_CONTROLLER_COUNT"], 0)
    pool = int_setting("SCALED_DB_POOL_SIZE", values["SCALED_DB_POOL_SIZE"], 1)
    overflow = int_setting("SCALED_DB_MAX_OVERFLOW", values["SCALED_DB_MAX_OVERFLOW"], 0)
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
    max_conn = (int_setting("SCALED_PG_MAX_CONNECTIONS", values["SCALED_PG_MAX_CONNECTIONS"], 20)
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
        **_sizes(values),
        "ports": ports,
    }


def _sizes(values: dict[str, str]) -> dict[str, int]:
    """Return the fleet's sizes (:func:`sized_for`), any set alone taking its own value."""
    sizes = sized_for(int_setting("SCALED_FLEET", values["SCALED_FLEET"], 1), open_file_limit())
    for key, name, least in (("lb_maxconn", "SCALED_LB_MAXCONN", 100),
                             ("lb_processes", "SCALED_LB_PROCESSES", 1),
                             ("controller_max_connections",
                              "SCALED_CONTROLLER_MAX_CONNECTIONS", 1)):
        if values[name]:
            sizes[key] = int_setting(name, values[name], least)
    return sizes


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
            "secrets": {name: make() for name, (make, _) in SECRETS.items()},
            "processes": {},
        }
        self.save()

    def secret(self, name: str) -> str:
        """Return the layout's secret name, refused (LayoutError) unless it has its shape."""
        value = self.state["secrets"].get(name)
        if value is None:
            raise LayoutError(f"{self.file} has no secret {name!r} (made before it existed):"
                              " run `down`, then `up`")
        if not isinstance(value, str) or not SECRETS[name][1].fullmatch(value):
            raise LayoutError(f"{self.file}: the secret {name!r} is malformed; restore the"
                              " file, or run `clean`")
        return value

    def missing_secrets(self) -> list[str]:
        """Return the secrets a layout made before they existed lacks."""
        return [name for name in SECRETS if name not in self.state["secrets"]]

    def add_secrets(self, names: list[str]) -> None:
        for name in names:
            self.state["secrets"][name] = SECRETS[name][0]()
        self.save()

    def check_env(self, env: dict[str, str], running: bool) -> list[str]:
        """Refuse an environment that asks for another layout than the one in the folder.

        The fleet's sizes (:data:`SIZED`) may change while nothing runs: they are kept and
        their names returned. Anything else (ports, processes, pools) needs ``clean``.
        """
        given = config_from_env(env)
        kept = self.state["config"]
        asked = {PORT_BASE_ENV, *SETTINGS, *(v for _, v in PORTS.values()),
                 "SCALED_API_PORTS", "SCALED_CONTROLLER_PORTS"} & set(env)
        if not asked or given == kept:
            return []
        diff = sorted(k for k in {*kept, *given} if kept.get(k) != given.get(k))
        if set(diff) <= set(SIZED) and not running:
            self.state["config"] = given
            self.save()
            return diff
        hint = ("run `down` first" if set(diff) <= set(SIZED)
                else "unset them, or run `clean` first")
        raise LayoutError(
            f"{self.dir} holds a layout made with other settings ({', '.join(diff)} differ"
            f" from {', '.join(sorted(asked))}); {hint}")

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_private(self.file, json.dumps(self.state, indent=2) + "\n")

    def make_private(self) -> list[Path]:
        """Make the layout's files 0600 and its folders 0700 (see :func:`make_private`)."""
        searchable = {self.dir, self.dir / "logs"} if os.geteuid() == 0 else set()
        return make_private(self.dir, searchable=searchable, skip={self.dir / "pg"})

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
        password = self.secret(f"pg_{db}")
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
