"""The scaled layout's Prefect processes and controllers: their environments and probes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sched_node.registration import SERVER_SETTINGS
from scripts.scaled_parts.config import ROOT, Layout, write_private
from scripts.scaled_parts.procs import SERVER_UMASK, LayoutError, alive, open_log, tail


def base_env(layout: Layout, home: Path) -> dict[str, str]:
    """The environment of a process we start: ours, less any Prefect or sched setting.

    ``PYTHONPATH`` is this checkout: the servers run its code (``ops.redis_messaging``,
    the controller), not that of another checkout the venv's editable install may point at.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "SCHED_", "SCALED_", "REDISCLI_"))}
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    env.update({"PREFECT_HOME": str(home), "DO_NOT_TRACK": "1", "PYTHONPATH": str(ROOT),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


def prefect_server_env(layout: Layout, home: Path) -> dict[str, str]:
    """The settings Prefect's "How to scale self-hosted Prefect" guide gives every server process.

    Every name was checked against Prefect 3.9.1 and prefect-redis 0.3.0 (docs/scaled.md).
    The secrets go in the environment (never on a command line, which ``ps`` shows anyone).
    """
    password = layout.secret("redis")
    redis = f"redis://:{password}@127.0.0.1:{layout.redis_port}"
    env = base_env(layout, home)
    env.update({
        # Every request but GET /api/health and /api/ready needs it (HTTP Basic); the services
        # process's own calls (automations' actions) go through the same check in-process.
        "PREFECT_SERVER_API_AUTH_STRING": layout.secret("prefect_auth"),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": layout.pg_url("prefect", "postgresql+asyncpg"),
        "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": str(layout.config["pool_size"]),
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": str(layout.config["max_overflow"]),
        # prefect-redis's broker, but an event's deduplication key and its stream entry are
        # written by one script: in two steps, a Redis restart or a dead API process between
        # them made the client's retry of the event look like a duplicate, and it was lost.
        "PREFECT_MESSAGING_BROKER": "ops.redis_messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_HOST": "127.0.0.1",
        "PREFECT_REDIS_MESSAGING_PORT": str(layout.redis_port),
        "PREFECT_REDIS_MESSAGING_DB": "0",
        "PREFECT_REDIS_MESSAGING_PASSWORD": password,
        # An API process holds the events it reads off a client's websocket in a batch of 5 (or
        # 10 s) before it writes them to Redis: a process killed in between loses them, after the
        # client has already counted them as delivered. One by one, there is nothing to lose.
        "PREFECT_REDIS_MESSAGING_PUBLISHER_BATCH_SIZE": "1",
        # Not in the guide: the worker channel's cleanup queue is per process by default.
        "PREFECT_SERVER_WORKER_CHANNEL_CLEANUP_QUEUE_STORAGE": "prefect_redis.cleanup_queue",
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_HOST": "127.0.0.1",
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PORT": str(layout.redis_port),
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_DB": "0",
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PASSWORD": password,
        "PREFECT_SERVER_DOCKET_URL": f"{redis}/1",
        # As `make run`: the services process deletes runs and events older than 7 days.
        "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
        **SERVER_SETTINGS,  # the nodes' deployments Ready between their polls
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": str(7 * 24 * 3600),
        "PREFECT_UI_API_URL": layout.prefect_url,
    })
    return env


def controller_env(layout: Layout) -> dict[str, str]:
    env = base_env(layout, layout.dir / "prefect" / "controller-client")
    env.update({"SCHED_DATABASE_URL": layout.pg_url("sched", "postgresql"),
                "SCHED_TOKENS_FILE": str(tokens_file(layout)),
                # HAProxy (on this machine) names each client in X-Forwarded-For.
                "SCHED_TRUSTED_PROXIES": "127.0.0.1",
                "PREFECT_API_URL": layout.prefect_url,
                "PREFECT_API_AUTH_STRING": layout.secret("prefect_auth")})
    return env


def tokens_file(layout: Layout) -> Path:
    path = layout.dir / "controller" / "tokens.toml"
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(path, f'admin = ["{layout.secret("admin_token")}"]\n[nodes]\n')
    return path


def run_tool(argv: list[str], env: dict[str, str], what: str, log: Path) -> None:
    """Run a one-shot command (a migration), its output appended to log; raise naming it."""
    with open_log(log) as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, check=False, timeout=600,
                                umask=SERVER_UMASK)
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
                             password=layout.secret("redis"), decode_responses=True)
        with client:
            for key in client.scan_iter(match="*:workers", count=1000):
                if client.type(key) == "zset" and any(
                        str(m).endswith(f"#{record['pid']}") for m in client.zrange(key, 0, -1)):
                    return True
    except Exception:  # Redis restarting: not ready yet
        return False
    return False
