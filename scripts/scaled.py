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
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# Run as a script (`python scripts/scaled.py`): this checkout's packages, not those of whatever
# checkout the venv's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.scaled_parts.balancer import (
    haproxy_conf,
    haproxy_servers,
    redis_conf,
    redis_ping,
)
from scripts.scaled_parts.config import (
    BIN,
    DEFAULT_DIR,
    LB_STATS_USER,
    PORT_BASE_ENV,
    START_TIMEOUT_ENV,
    Layout,
    Tools,
    config_from_env,
    int_setting,
    write_private,
)
from scripts.scaled_parts.postgres import (
    Postgres,
)
from scripts.scaled_parts.procs import (
    LayoutError,
    alive,
    http_ok,
    port_free,
    say,
    spawn,
    stop,
    tail,
)
from scripts.scaled_parts.services import (
    base_env,
    controller_env,
    prefect_server_env,
    run_tool,
    services_ready,
)


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
            ceiling = layout.config.get("controller_max_connections", 4000)
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
    """Start whatever part is not running, in order, and wait until each answers."""
    began = time.monotonic()
    tools = Tools.find()
    env = dict(os.environ)
    timeout = float(int_setting(START_TIMEOUT_ENV, env.get(START_TIMEOUT_ENV, "240"), 1))
    _settle_config(layout, env)
    _settle_secrets(layout)
    for folder in ("logs", "prefect"):  # (each Prefect process's home is in prefect/)
        (layout.dir / folder).mkdir(mode=0o700, exist_ok=True)
    if private := layout.make_private():
        say(f"made private (no group or other permissions): {len(private)} files and folders")
    started = [*_start_postgres(layout, tools), *_start_redis(layout, tools),
               *_start_balancers(layout, tools), *_start_servers(layout, timeout)]
    _wait_balanced(layout)
    write_client_env(layout)
    elapsed = time.monotonic() - began
    say(f"up in {elapsed:.1f} s; started: {', '.join(started) or 'nothing (all were running)'}")
    status(layout)


def _settle_config(layout: Layout, env: dict[str, str]) -> None:
    """Check env against the layout's kept settings, or keep them at the first ``up``."""
    if layout.exists:
        running = any(alive(layout.proc(name)) for name in layout.state["processes"])
        if resized := layout.check_env(env, running):
            _say_size(layout.config, f" ({', '.join(resized)} changed)")
        return
    config = config_from_env(env)
    taken = [f"{part} {port}" for part, port in _all_ports(config) if not port_free(port)]
    if taken:
        raise LayoutError(
            f"ports in use: {', '.join(taken)}; set {PORT_BASE_ENV} (default 27200) or the"
            " per-part variable (docs/scaled.md) to free ones")
    layout.create(config)
    _say_size(config)


def _say_size(config: dict[str, Any], why: str = "") -> None:
    say(f"sized for {config['fleet']:,} nodes (SCALED_FLEET): each controller "
        f"--max-connections {config['controller_max_connections']:,}, HAProxy maxconn "
        f"{config['lb_maxconn']:,} in {config['lb_processes']} process(es){why}")


def _settle_secrets(layout: Layout) -> None:
    """Give a layout made before some of its secrets existed those secrets, once nothing of
    it runs (a running Redis or Prefect process would go on without them)."""
    missing = layout.missing_secrets()
    if not missing:
        return
    running = [name for name in layout.state["processes"] if alive(layout.proc(name))]
    if running:
        raise LayoutError(
            f"{layout.dir} was made before its {', '.join(missing)} secrets existed, and"
            f" {', '.join(running)} run without them: run `down`, then `up`")
    layout.add_secrets(missing)
    say(f"new secrets in {layout.file}: {', '.join(missing)}")


def _start_postgres(layout: Layout, tools: Tools) -> list[str]:
    pg = Postgres(layout, tools)
    started = []
    if not pg.running():
        pg.init()
        pg.start()
        started.append("postgres")
    pg.ensure_databases()
    return started


def _start_redis(layout: Layout, tools: Tools) -> list[str]:
    started = []
    if not alive(layout.proc("redis")):
        conf = redis_conf(layout)
        layout.set_proc("redis", spawn([tools.redis, str(conf)], base_env(layout, layout.dir),
                                       layout.dir / "redis" / "stdout.log", layout.dir))
        started.append("redis")
    deadline = time.monotonic() + 60
    while not redis_ping(layout.redis_port, layout.secret("redis")):
        if not alive(layout.proc("redis")) or time.monotonic() > deadline:
            raise LayoutError(f"Redis did not answer on {layout.redis_port}:\n"
                              f"{tail(layout.log('redis'))}")
        time.sleep(0.1)
    return started


def _start_balancers(layout: Layout, tools: Tools) -> list[str]:
    started = []
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
    return started


def _start_servers(layout: Layout, timeout: float) -> list[str]:
    """Migrate and start the Prefect processes and the controllers not running; wait for all."""
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
    if to_start or controllers_to_start:
        say(f"started {', '.join(p.name for p in to_start + controllers_to_start)}; waiting")
    wait_ready(layout, prefect_parts + controller_parts, timeout)
    return [part.name for part in to_start + controllers_to_start]


def _wait_balanced(layout: Layout) -> None:
    """Wait until every API process is UP in HAProxy's checks and /api/health answers."""
    deadline = time.monotonic() + 60
    want = {f"prefect_api/{n}" for n in layout.api_names()} | {
        f"controller_api/{n}" for n in layout.controller_names()}
    while True:
        seen = {lb: haproxy_servers(layout, lb) for lb in layout.lb_names()}
        if (all(servers.get(s) == "UP" for servers in seen.values() for s in want)
                and http_ok(f"{layout.prefect_url}/health")):
            return
        if time.monotonic() > deadline:
            raise LayoutError(f"HAProxy does not see every server UP: {seen}; see"
                              f" {', '.join(str(layout.log(lb)) for lb in seen)}")
        time.sleep(0.3)


def _all_ports(config: dict[str, Any]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for part, value in config["ports"].items():
        for i, port in enumerate(value if isinstance(value, list) else [value]):
            out.append((f"{part}{i + 1}" if isinstance(value, list) else part, port))
    return out


def write_client_env(layout: Layout) -> list[Path]:
    """Write client.env (what a node or an operator needs: addresses, Prefect's auth string,
    the admin token) and admin.env (the layout's own passwords), both 0600."""
    stats = f"{LB_STATS_USER}:{layout.secret('lb_stats')}"
    return [write_private(layout.dir / "client.env", (
        "# source this file: a node's or an operator's view of the scaled layout\n"
        f"export PREFECT_API_URL={layout.prefect_url}\n"
        f"export PREFECT_API_AUTH_STRING={layout.secret('prefect_auth')}\n"
        f"export SCHED_CONTROLLER_URL={layout.controller_url}\n"
        f"export SCHED_TOKEN={layout.secret('admin_token')}\n")),
        write_private(layout.dir / "admin.env", (
        "# source this file: the layout's own passwords, for this machine's operator\n"
        f"# redis-cli -p {layout.redis_port} info memory\n"
        f"export REDISCLI_AUTH={layout.secret('redis')}\n"
        f"# curl -u \"$SCALED_STATS_AUTH\" http://127.0.0.1:{layout.ports['lb_stats']}/\n"
        f"export SCALED_STATS_AUTH={stats}\n"))]


def down(layout: Layout) -> None:
    if not layout.exists:
        say(f"nothing to stop: no layout in {layout.dir}")
        return
    tools = Tools.find()
    # The balancer first (no new requests), then the Prefect processes and controllers
    # together, then what they use.
    groups = [layout.lb_names(),
              [*layout.controller_names(), *layout.api_names(), "prefect-services"], ["redis"]]
    records = {name: layout.proc(name) for group in groups for name in group}
    for group in groups:
        stop({name: records[name] for name in group})
        for name in group:
            layout.set_proc(name, None)
    pg = Postgres(layout, tools)
    pg.stop()
    left = [name for name, record in records.items() if alive(record)]
    if pg.running():
        left.append("postgres")
    if left:
        raise LayoutError(f"still running: {', '.join(left)}")
    say(f"down: every part stopped; the data stays in {layout.dir} (`clean` deletes it)")


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
    redis_up = alive(redis_rec) and redis_ping(layout.redis_port, layout.secret("redis"))
    rows.append(("redis", redis_up, f"127.0.0.1:{layout.redis_port} (password)",
                 str((redis_rec or {}).get("pid", "-")), str(layout.log("redis"))))
    for lb_name in layout.lb_names():
        lb_rec = layout.proc(lb_name)
        stats_page = (f", http://127.0.0.1:{layout.ports['lb_stats']}/ (stats, password)"
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
    print(f"  clients: source {layout.dir / 'client.env'} (PREFECT_API_URL,"
          " PREFECT_API_AUTH_STRING, SCHED_CONTROLLER_URL, SCHED_TOKEN)")
    print(f"  this machine's operator: source {layout.dir / 'admin.env'} (REDISCLI_AUTH,"
          " SCALED_STATS_AUTH)")
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
