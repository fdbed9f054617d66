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


QUEUE_S = 20
"""How long a request waits in HAProxy's queue for a free slot on a Prefect API process
before HAProxy answers 503 with ``Retry-After`` (a node's records wait in its outbox)."""
RETRY_AFTER_S = 30
"""The ``Retry-After`` of HAProxy's own 503s: nodes come back later, not at once."""
NODE_AGENT = "sched-agent"
"""The User-Agent of the nodes' Prefect client (sched_node/prefect_api.py): their requests
queue behind everyone else's."""


def _balanced(name: str, bind: str, maxconn: object, health: str,
              servers: list[tuple[str, int]], hold_s: int | None = None,
              forward_for: bool = False, inflight: int | None = None) -> str:
    """One HAProxy frontend and its backend: least connections, servers checked on health.

    ``hold_s``: how long an answer may take (the defaults' 120 s otherwise). A health check
    may take :data:`CHECK_TIMEOUT_S` to be answered: a dead process (connection refused)
    is still out after two checks (~4 s), but one busy for less is not taken out.
    ``forward_for``: add the client's address to ``X-Forwarded-For`` (the controllers trust
    it from loopback only).

    ``inflight``: at most this many requests at once on each server; the rest wait in
    HAProxy's queue (up to :data:`QUEUE_S`, then a 503 with ``Retry-After``), people's
    and tools' requests ahead of the nodes' (priority class by User-Agent). Health checks
    are not queued, so a busy server is never taken out for its queue. Prefect's event
    websockets (``/api/events/in``, ``/out``: held for hours) go to a backend of their own
    with no such bound.
    """
    def lines(how: str) -> str:  # how: each server's options; {server} names it
        return "\n".join(f"    server {server} 127.0.0.1:{port} {how.format(server=server)}"
                         for server, port in servers)

    client = f"\n    timeout client {hold_s}s" if hold_s else ""
    server = f"\n    timeout server {hold_s}s" if hold_s else ""
    server += "\n    option forwardfor" if forward_for else ""
    rules = "" if inflight is None else f"""
    http-request set-priority-class int(1) if {{ req.hdr(user-agent) -m beg {NODE_AGENT} }}
    http-after-response set-header Retry-After {RETRY_AFTER_S} if {{ status 503 }}
    use_backend {name}_streams if {{ path_beg /api/events/in /api/events/out }}"""
    front = f"""
frontend {name}
    bind {bind}
    maxconn {maxconn}{client}{rules}
    default_backend {name}_api
"""
    check = f"""    option httpchk GET {health}
    http-check expect status 200
    timeout check {CHECK_TIMEOUT_S}s
    default-server inter 2s fall 2 rise 2"""
    if inflight is None:
        return f"""{front}
backend {name}_api
    balance leastconn{server}
{check}
{lines('check')}
"""
    return f"""{front}
backend {name}_api
    balance leastconn{server}
    timeout queue {QUEUE_S}s
{check}
{lines(f'check maxconn {inflight}')}

backend {name}_streams
    balance leastconn{server}
{lines(f'track {name}_api/{{server}}')}
"""


def haproxy_conf(layout: Layout, name: str = "haproxy") -> Path:
    """The configuration of the balancer's process name (``Layout.lb_names``): the same
    frontends for each; the first also serves the stats page, and each has its own socket."""
    folder = layout.dir / "haproxy"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    ports, bind, maxconn = layout.ports, layout.config["bind"], layout.config["lb_maxconn"]
    # Each API process takes at most as many requests at once as its database pool holds
    # connections (more only wait inside it for one); the rest wait in HAProxy's queue.
    inflight = int(layout.config["pool_size"]) + int(layout.config["max_overflow"])
    prefect_part = _balanced("prefect", f"{bind}:{ports['prefect_lb']}", maxconn, "/api/health",
                             list(zip(layout.api_names(), ports["api"], strict=True)),
                             inflight=inflight)
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
