"""``sched controller``: serve the API and the central scheduler, run the migrations.

Configuration comes from the flags and the environment (:mod:`controller.settings`,
``SCHED_DATABASE_URL``, the tokens, ``SCHED_RETRY_DELAY``); flags override the URL.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from controller.auth import Tokens
from controller.connections import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_WRITE_TIMEOUT,
    ConnectionLimits,
)
from controller.defaults import DEFAULT_DISPATCH_RETENTION, DEFAULT_MAX_ATTEMPTS
from controller.logtext import printable, redact_credentials
from sched_core.errors import ConfigError

if TYPE_CHECKING:
    from controller.central_settings import CentralSettings

app = typer.Typer(
    help="The controller: the schedule API agents pull from, and the central scheduler.",
    no_args_is_help=True,
)

_URL_HELP = "Database URL (default: SCHED_DATABASE_URL, else the embedded SQLite file)."


_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName", "color_message",
}


_SELF_DESCRIBING = frozenset({"controller.access"})
"""Loggers whose messages already spell out their fields (the access log)."""


class ContextFormatter(logging.Formatter):
    """The message, then each ``extra`` field of the record as ``key=value``, one line each.

    The controller logs its context (task, scheduled time, worker, error,
    attempts, retry delay) as extra fields; without this a plain format would
    drop them and leave "dispatch failed; will retry" with no task named.
    Every character that is not printable (a newline, a terminal escape
    sequence in a task name or a node name) is escaped, in the message and
    in each field; a traceback keeps its newlines and nothing else.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = printable(super().formatMessage(record))
        if record.name in _SELF_DESCRIBING:
            return redact_credentials(text)
        context = [
            f"{key}={_field(value)}" for key, value in record.__dict__.items()
            if key not in _RECORD_FIELDS and not key.startswith("_")
        ]
        return redact_credentials(f"{text} {' '.join(context)}" if context else text)

    def formatException(self, ei: Any) -> str:
        return redact_credentials(printable(super().formatException(ei), keep_newlines=True))

    def formatStack(self, stack_info: str) -> str:
        return redact_credentials(printable(super().formatStack(stack_info), keep_newlines=True))


def _field(value: object) -> str:
    text = value.isoformat() if hasattr(value, "isoformat") else str(value)
    if not text or any(c.isspace() or c in "'\"=" for c in text):
        text = repr(text)
    return printable(text)


QUIET_LOGGERS = ("httpx", "httpcore")
"""Libraries whose INFO lines (one per HTTP request, the whole URL) the controller drops."""


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(ContextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level.upper())
    # httpx logs every request of Prefect's client at INFO with its whole URL, a
    # PREFECT_API_URL's password included: warnings only (and those redacted).
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def _fail(message: str) -> NoReturn:
    """Say ``error: message`` on stderr and exit 2 (a configuration the command refuses)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2) from None


def _serving_tokens(insecure_no_auth: bool) -> Tokens:
    """Return the tokens the API answers to: the environment's, or none (--insecure-no-auth)."""
    try:
        tokens = Tokens.from_env()
    except ConfigError as exc:
        _fail(str(exc))
    if insecure_no_auth:
        logging.getLogger("controller.cli").warning(
            "serving WITHOUT authentication (--insecure-no-auth): every caller is the admin"
        )
        return Tokens(insecure=True)
    if not tokens.has_admin:
        _fail("no admin token: set SCHED_ADMIN_TOKEN (or `admin` in the file named by "
              "SCHED_TOKENS_FILE), or pass --insecure-no-auth to serve without tokens")
    tokens.warn_short()
    return tokens


def _check_prefect() -> None:
    """Exit 2 unless the central scheduler has a Prefect API to dispatch to."""
    from controller.dispatch import prefect_api_url

    try:
        prefect_api_url()
    except ConfigError as exc:
        _fail(f"the central scheduler cannot start: {exc}; or pass --api-only")


def _scheduler_settings(max_attempts: int, dispatch_retention_days: float,
                        durable_claims: bool) -> CentralSettings:
    """Return the central scheduler's settings: the flags' and ``SCHED_RETRY_DELAY``."""
    from controller.central import CentralSettings

    return CentralSettings.from_env(
        max_attempts=max_attempts,
        dispatch_retention=dispatch_retention_days * 86400 or None,
        durable_claims=durable_claims,
    )


def _check_schema(database_url: str | None) -> None:
    """Exit 2 if the database is not at the latest schema (unreachable: a warning only)."""
    from controller.db import schema_problem

    try:
        problem = schema_problem(database_url)
    except Exception as exc:  # unreachable: serve waits for it like for any outage
        logging.getLogger("controller.cli").warning(
            "could not read the database's schema version at start-up: %s",
            repr(exc)[:300])
        problem = None
    if problem is not None:
        _fail(problem)


# `sched controller serve`'s options, one alias each (typer reads them from the annotations).
HostOpt = Annotated[str, typer.Option(help="Address to listen on.")]
PortOpt = Annotated[int, typer.Option(help="Port to listen on.")]
ApiOnlyOpt = Annotated[bool, typer.Option("--api-only", help="Run the HTTP API only.")]
SchedulerOnlyOpt = Annotated[bool, typer.Option(
    "--scheduler-only", help="Run the central scheduler only (no HTTP).")]
InsecureNoAuthOpt = Annotated[bool, typer.Option(
    "--insecure-no-auth",
    help="Serve without tokens: every caller is the admin. Never on a shared network.")]
DatabaseUrlOpt = Annotated[str | None, typer.Option("--database-url", help=_URL_HELP)]
PullCacheMbOpt = Annotated[int, typer.Option(
    min=0, help="MiB of pull answers cached per process, keyed by ETag (0: off).")]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning or error.")]
PullIntervalOpt = Annotated[float, typer.Option(
    min=1,
    help="Seconds between a node's periodic pulls (the agents' reconcile_interval): "
    "what a write's answer counts on without an event.")]
# The serve flags are Annotated aliases alike in shape (a type, a typer.Option, its help):
# one per flag, read by the generated flag table (scripts/settings_docs.py).
StaleAfterOpt = Annotated[float | None, typer.Option(
    min=1,
    help="Seconds without a request of its own before a node that announced "
    "no heartbeat (an older agent) is silent (default: 3 pull intervals, at least 900); "
    "a node that announces one is silent after 3 of its heartbeats.")]
ReportHistoryOpt = Annotated[int, typer.Option(min=1, help="Reports kept per node (the newest).")]
MaxAttemptsOpt = Annotated[int, typer.Option(
    min=0,
    help="Failed dispatches of one (task, scheduled time) before giving up on it: a "
    "recurring task moves on to its next run, a one-shot task is disabled (0: never).")]
DispatchRetentionDaysOpt = Annotated[float, typer.Option(
    min=0, help="Days finished dispatch records are kept, pruned hourly (0: keep forever).")]
DurableClaimsOpt = Annotated[bool, typer.Option(
    "--durable-claims",
    help="Make each claim wait for the WAL flush on Postgres (slower wake-up; a claim "
    "lost in a database crash is otherwise re-dispatched under the same idempotency key).")]
SslCertfileOpt = Annotated[str | None, typer.Option(
    "--ssl-certfile", help="Serve HTTPS with this PEM certificate (chain).")]
SslKeyfileOpt = Annotated[str | None, typer.Option(
    "--ssl-keyfile", help="The certificate's PEM private key (chmod 600).")]
MaxConnectionsOpt = Annotated[int, typer.Option(
    min=1,
    help="Open connections at most (a node's long poll holds one; 1,000 nodes with their "
    "pulls and reports fit the default); past it a new one takes the place of the oldest "
    "idle one, else gets 503 and is closed (lowered to fit the open-file limit).")]
HeaderTimeoutOpt = Annotated[float, typer.Option(
    min=0.1,
    help="Seconds a client has to send its request line and headers (408, then closed).")]
BodyTimeoutOpt = Annotated[float, typer.Option(
    min=0.1, help="Seconds a client has to send a request body once its headers are in (408).")]
WriteTimeoutOpt = Annotated[float, typer.Option(
    min=0.1, help="Seconds a client may leave its answer unread before it is cut off.")]
TokensCheckIntervalOpt = Annotated[float, typer.Option(
    min=0,
    help="Seconds between looks at the tokens file for a change (0: reload on SIGHUP only).")]
WatchIntervalOpt = Annotated[float, typer.Option(
    min=0,
    help="Seconds between the fleet watch's passes, which raise alerts (a silent node, a "
    "missed or failed window, their recovery) as Prefect events (0: off).")]
JobRetentionDaysOpt = Annotated[float, typer.Option(
    min=0.01, help="Days the nodes' job records are kept.")]
JobHistoryOpt = Annotated[int, typer.Option(
    min=1, help="Job records kept per node at most (the newest).")]


@dataclass(frozen=True)
class ServeOptions:
    """What `sched controller serve` was given (its flags, checked by typer)."""

    host: str
    port: int
    api_only: bool
    scheduler_only: bool
    insecure_no_auth: bool
    database_url: str | None
    pull_cache_mb: int
    log_level: str
    pull_interval: float
    stale_after: float | None
    report_history: int
    max_attempts: int
    dispatch_retention_days: float
    durable_claims: bool
    ssl_certfile: str | None
    ssl_keyfile: str | None
    max_connections: int
    header_timeout: float
    body_timeout: float
    write_timeout: float
    tokens_check_interval: float
    watch_interval: float
    job_retention_days: float
    job_history: int


@app.command()
def serve(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8080,
    api_only: ApiOnlyOpt = False,
    scheduler_only: SchedulerOnlyOpt = False,
    insecure_no_auth: InsecureNoAuthOpt = False,
    database_url: DatabaseUrlOpt = None,
    pull_cache_mb: PullCacheMbOpt = 64,
    log_level: LogLevelOpt = "info",
    pull_interval: PullIntervalOpt = 900.0,
    stale_after: StaleAfterOpt = None,
    report_history: ReportHistoryOpt = 50,
    max_attempts: MaxAttemptsOpt = DEFAULT_MAX_ATTEMPTS,
    dispatch_retention_days: DispatchRetentionDaysOpt = DEFAULT_DISPATCH_RETENTION / 86400,
    durable_claims: DurableClaimsOpt = False,
    ssl_certfile: SslCertfileOpt = None,
    ssl_keyfile: SslKeyfileOpt = None,
    max_connections: MaxConnectionsOpt = DEFAULT_MAX_CONNECTIONS,
    header_timeout: HeaderTimeoutOpt = DEFAULT_HEADER_TIMEOUT,
    body_timeout: BodyTimeoutOpt = DEFAULT_BODY_TIMEOUT,
    write_timeout: WriteTimeoutOpt = DEFAULT_WRITE_TIMEOUT,
    tokens_check_interval: TokensCheckIntervalOpt = 2.0,
    watch_interval: WatchIntervalOpt = 15.0,
    job_retention_days: JobRetentionDaysOpt = 14.0,
    job_history: JobHistoryOpt = 50_000,
) -> None:
    """Run the API and the central scheduler in one process (or either alone, to scale).

    SIGINT or SIGTERM stops it; SIGHUP reloads the tokens file (which is also
    reloaded when it changes on disk).
    """
    _serve(ServeOptions(**locals()))


def _serve(o: ServeOptions) -> None:
    """Check what serve was given, then run (the steps above)."""
    if o.api_only and o.scheduler_only:
        raise typer.BadParameter("--api-only and --scheduler-only exclude each other")
    _setup_logging(o.log_level)
    from controller.server import check_tls_files

    try:
        check_tls_files(o.ssl_certfile, o.ssl_keyfile)
    except ConfigError as exc:
        _fail(str(exc))
    tokens = None if o.scheduler_only else _serving_tokens(o.insecure_no_auth)
    if not o.api_only:
        _check_prefect()
    from controller.fleet import FleetSettings

    try:
        fleet_settings = FleetSettings(pull_interval=o.pull_interval, stale_after=o.stale_after,
                                       report_history=o.report_history,
                                       job_retention_days=o.job_retention_days,
                                       job_history=o.job_history)
        settings = _scheduler_settings(o.max_attempts, o.dispatch_retention_days, o.durable_claims)
    except ConfigError as exc:
        _fail(str(exc))
    _check_schema(o.database_url)
    from controller.server import run
    from controller.settings import ControllerSettings

    try:
        proxies = ControllerSettings.read().proxy_networks()
    except ConfigError as exc:
        _fail(str(exc))

    run(
        url=o.database_url,
        tokens=tokens,
        host=o.host,
        port=o.port,
        api=not o.scheduler_only,
        scheduler=not o.api_only,
        log_level=o.log_level,
        pull_cache_bytes=o.pull_cache_mb << 20,
        scheduler_settings=settings,
        limits=ConnectionLimits(max_connections=o.max_connections,
                                header_timeout=o.header_timeout, body_timeout=o.body_timeout,
                                write_timeout=o.write_timeout),
        ssl_certfile=o.ssl_certfile,
        ssl_keyfile=o.ssl_keyfile,
        tokens_check_interval=o.tokens_check_interval,
        fleet_settings=fleet_settings,
        watch_interval=o.watch_interval,
        trusted_proxies=proxies,
    )


@app.command()
def migrate(
    revision: str | None = typer.Option(
        None, help="Target revision (default: head; required with --downgrade, e.g. -1 or base)."
    ),
    downgrade: bool = typer.Option(False, "--downgrade", help="Go down to --revision."),
    database_url: str | None = typer.Option(None, "--database-url", help=_URL_HELP),
) -> None:
    """Upgrade the database to the latest schema (or --downgrade to a revision)."""
    from controller import db

    try:
        url = db.database_url(database_url)
    except ConfigError as exc:  # the environment (ControllerSettings) is checked whole
        _fail(str(exc))
    if downgrade:
        if revision is None:
            typer.echo("error: --downgrade needs --revision (e.g. -1 or base)", err=True)
            raise typer.Exit(2)
        db.downgrade(url, revision)
        typer.echo(f"downgraded {db.safe_url(url)} to {revision}")
        return
    target = revision or "head"
    try:
        db.migrate(url, target)
    except ConfigError as exc:  # a schema these migrations do not know
        _fail(str(exc))
    typer.echo(f"migrated {db.safe_url(url)} to {target}")
