"""The scaled layout's Redis and HAProxy: their configuration, probes and statistics."""

from __future__ import annotations

import socket
from pathlib import Path

from scripts.scaled_parts.config import LB_STATS_USER, Layout, write_private


def redis_conf(layout: Layout) -> Path:
    """Redis's configuration (0600: it holds the password every client must give)."""
    folder = layout.dir / "redis"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return write_private(
        folder / "redis.conf",
        "# the scaled layout (scripts/scaled.py): Prefect's messages, cache, leases, docket\n"
        "bind 127.0.0.1\n"
        f"port {layout.redis_port}\n"
        "protected-mode yes\n"
        # Any local user reaches 127.0.0.1: without it, anyone could read the events or
        # drop the leases. The default user's password (Redis's ACL), hex: one word here.
        f"requirepass {layout.secret('redis')}\n"
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


def _resp(*words: str) -> bytes:
    """Return one Redis command in its wire form (RESP): each word sent as it is, whatever
    it holds."""
    out = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def redis_ping(port: int, password: str) -> bool:
    """Return True when the Redis on port takes password and answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(_resp("AUTH", password) + _resp("PING"))
            answer = b""
            while answer.count(b"\r\n") < 2 and not answer.startswith(b"-"):
                chunk = sock.recv(64)
                if not chunk:
                    break
                answer += chunk
            return answer == b"+OK\r\n+PONG\r\n"
    except OSError:
        return False


CHECK_TIMEOUT_S = 15
"""How long HAProxy waits for a server's health answer (its ``timeout check``)."""


def _balanced(name: str, bind: str, maxconn: object, health: str,
              servers: list[tuple[str, int]], hold_s: int | None = None,
              forward_for: bool = False) -> str:
    """One HAProxy frontend and its backend: least connections, servers checked on health.

    ``hold_s``: how long an answer may take (the defaults' 120 s otherwise). A health check
    may take :data:`CHECK_TIMEOUT_S` to be answered: a dead process (connection refused)
    is still out after two checks (~4 s), but one busy for less is not taken out. With the check's
    own 2 s, both API processes of a 10,000-node fleet's peak were marked down in turn and
    HAProxy answered 503 itself (``<NOSRV>``), ~1,600 in 3 minutes. ``forward_for``: add the
    client's address to ``X-Forwarded-For`` (the controllers trust it from loopback only).
    """
    lines = "\n".join(f"    server {server} 127.0.0.1:{port} check" for server, port in servers)
    client = f"\n    timeout client {hold_s}s" if hold_s else ""
    server = f"\n    timeout server {hold_s}s" if hold_s else ""
    server += "\n    option forwardfor" if forward_for else ""
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
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    ports, bind, maxconn = layout.ports, layout.config["bind"], layout.config["lb_maxconn"]
    prefect_part = _balanced("prefect", f"{bind}:{ports['prefect_lb']}", maxconn, "/api/health",
                             list(zip(layout.api_names(), ports["api"], strict=True)))
    controllers = list(zip(layout.controller_names(), ports["controller"], strict=True))
    # A node's long poll is held up to 300 s (a heartbeat that long): 30 s more to answer.
    controller_part = _balanced("controller", f"{bind}:{ports['controller_lb']}", maxconn,
                                "/healthz", controllers, hold_s=330,
                                forward_for=True) if controllers else ""
    first = name == "haproxy"
    # The stats page names every server and its traffic: loopback only, and behind a
    # password (HTTP Basic; the file is 0600 for it).
    stats = "" if not first else f"""
frontend stats
    bind 127.0.0.1:{ports['lb_stats']}
    stats enable
    stats uri /
    stats refresh 5s
    stats realm scaled-layout
    stats auth {LB_STATS_USER}:{layout.secret('lb_stats')}
"""
    conf = folder / ("haproxy.cfg" if first else f"{name}.cfg")
    return write_private(conf, f"""# the scaled layout (scripts/scaled.py); see docs/scaled.md
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
