"""`sched controller migrate` and `serve` as real subprocesses, on a temporary SQLite file."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from controller.db import migrate
from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from controller.cli import app; app()"]
ADMIN_TOKEN = "cli-admin-token-4242"
NODE_TOKEN = "cli-node-token-1717"


def clean_env(**extra: str) -> dict[str, str]:
    """Return the environment without any SCHED_* setting, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHED_")}
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=ROOT, env=env or clean_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    conn.close()
    return {name for (name,) in rows}


def test_migrate_goes_up_and_down(tmp_path: Path) -> None:
    path = tmp_path / "controller.db"
    url = f"sqlite:///{path}"

    up = run_cli("migrate", "--database-url", url)
    assert up.returncode == 0, up.stderr
    assert {"agent_schedule", "scheduled_task", "alembic_version"} <= tables(path)

    refused = run_cli("migrate", "--downgrade", "--database-url", url)
    assert refused.returncode == 2
    assert "--revision" in refused.stderr
    assert "agent_schedule" in tables(path)

    down = run_cli("migrate", "--downgrade", "--revision", "base", "--database-url", url)
    assert down.returncode == 0, down.stderr
    assert not {"agent_schedule", "scheduled_task"} & tables(path)

    # The URL may come from the environment instead of the flag.
    again = run_cli("migrate", env=clean_env(SCHED_DATABASE_URL=url))
    assert again.returncode == 0, again.stderr
    assert "agent_schedule" in tables(path)


def test_migrate_reports_the_url_without_its_password(tmp_path: Path) -> None:
    url = "postgresql://sched:hunter2-secret@127.0.0.1:1/sched?connect_timeout=1"
    result = run_cli("migrate", "--database-url", url)
    assert result.returncode != 0
    assert "hunter2-secret" not in result.stdout


@pytest.mark.parametrize(
    "env",
    [
        {"SCHED_NODE_TOKENS": f"node-a={NODE_TOKEN}"},
        {},
        {"SCHED_ADMIN_TOKEN": "  "},
    ],
)
def test_serve_refuses_to_start_without_an_admin_token(
    tmp_path: Path, env: dict[str, str]
) -> None:
    result = run_cli(
        "serve", "--api-only", "--port", str(free_port()),
        env=clean_env(SCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}", **env),
    )
    assert result.returncode == 2
    assert "no admin token" in result.stderr
    assert "--insecure-no-auth" in result.stderr
    assert NODE_TOKEN not in result.stdout + result.stderr


def test_serve_refuses_a_database_not_at_the_latest_schema(tmp_path: Path) -> None:
    """Not a 500 on every request: serve says to migrate, and migrating lets it start."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    env = clean_env(SCHED_DATABASE_URL=url, SCHED_ADMIN_TOKEN=ADMIN_TOKEN)
    from alembic.script import ScriptDirectory

    from controller import db

    head = ScriptDirectory.from_config(db.alembic_config("sqlite://")).get_current_head()
    empty = run_cli("serve", "--api-only", "--port", str(free_port()), env=env)
    assert empty.returncode == 2
    assert f"is at no schema at all, and this controller needs {head}" in empty.stderr
    assert "run `sched controller migrate` first" in empty.stderr
    assert run_cli("migrate", env=env).returncode == 0
    # A database a pre-release controller made: named, and nothing is changed by migrate.
    import sqlite3

    with sqlite3.connect(tmp_path / "c.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0011'")
    older = run_cli("serve", "--api-only", "--port", str(free_port()), env=env)
    assert older.returncode == 2
    assert "is at 0011, a schema this controller does not know" in older.stderr
    refused = run_cli("migrate", env=env)
    assert refused.returncode == 2 and "is at 0011, a schema" in refused.stderr
    assert "Traceback" not in refused.stderr
    with sqlite3.connect(tmp_path / "c.db") as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0011",)]


def test_serve_refuses_a_bad_token_configuration_without_echoing_it(tmp_path: Path) -> None:
    result = run_cli(
        "serve", "--api-only", "--port", str(free_port()),
        env=clean_env(SCHED_ADMIN_TOKEN=ADMIN_TOKEN, SCHED_NODE_TOKENS="just-a-secret-value"),
    )
    assert result.returncode == 2
    assert "SCHED_NODE_TOKENS" in result.stderr
    assert "just-a-secret-value" not in result.stdout + result.stderr
    assert ADMIN_TOKEN not in result.stdout + result.stderr


def test_api_only_and_scheduler_only_exclude_each_other() -> None:
    result = run_cli("serve", "--api-only", "--scheduler-only")
    assert result.returncode != 0
    assert "exclude each other" in result.stderr


_PIDS: dict[str, int] = {}
"""The process id of each running `serving` block, by its base URL."""


def _serve_pid(base: str) -> int:
    return _PIDS[base]


@contextmanager
def serving(tmp_path: Path, *args: str, **env: str) -> Iterator[tuple[str, Path]]:
    """Run `serve` as a subprocess until the block ends; yield its URL and stderr file."""
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), *args], cwd=ROOT,
            env=clean_env(SCHED_DATABASE_URL=url, **env),
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    tls = "--ssl-certfile" in args
    base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    verify: ssl.SSLContext | bool = True
    if tls:
        verify = ssl.create_default_context(cafile=args[args.index("--ssl-certfile") + 1])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"{base}/healthz", timeout=5, verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)  # polling for the server to come up
        _PIDS[base] = proc.pid
        yield base, log_path
    finally:
        _PIDS.pop(base, None)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0, log_path.read_text()


SCHEDULE = {
    "name": "nightly", "action": "backup",
    "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
    "miss_policy": "skip", "enabled": True,
}


def test_serve_api_only_answers_with_auth_and_logs_without_tokens(tmp_path: Path) -> None:
    with serving(tmp_path, "--api-only", SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 SCHED_NODE_TOKENS=f"node-a={NODE_TOKEN}", PREFECT_API_URL="") as (base, log_path):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        node = {"Authorization": f"Bearer {NODE_TOKEN}"}
        put = httpx.put(f"{base}/api/nodes/node-a/schedules/s-1", json=SCHEDULE, headers=admin)
        assert put.status_code == 200, put.text
        # No PREFECT_API_URL: no sched.schedules.updated event, said in the answer.
        assert put.json()["_propagation"]["event_sent"] is False
        assert "PREFECT_API_URL is not set" in put.json()["_propagation"]["reason"]
        pulled = httpx.get(f"{base}/api/schedules?node=node-a", headers=node)
        assert pulled.status_code == 200
        assert [s["id"] for s in pulled.json()["schedules"]] == ["s-1"]
        assert httpx.get(f"{base}/api/schedules?node=node-b", headers=node).status_code == 403
        assert httpx.get(f"{base}/api/schedules?node=node-a").status_code == 401
    log = log_path.read_text()
    assert "WARNING controller.events: the controller has no Prefect API" in log  # at start-up
    assert "GET /api/schedules node=node-a principal=node:node-a status=200" in log
    assert "principal=node:node-a status=403" in log
    assert "status=401" in log
    assert ADMIN_TOKEN not in log
    assert NODE_TOKEN not in log


def test_serve_insecure_no_auth_makes_every_caller_admin(tmp_path: Path) -> None:
    with serving(tmp_path, "--api-only", "--insecure-no-auth") as (base, log_path):
        response = httpx.get(f"{base}/api/schedules?node=any")
        assert response.status_code == 200
        assert response.json() == {"schedules": []}
    assert "WITHOUT authentication" in log_path.read_text()


NO_PREFECT = "http://127.0.0.1:9/api"  # configured, never reached: no task is due


def test_serve_refuses_to_run_the_scheduler_without_a_prefect_api(tmp_path: Path) -> None:
    """Without PREFECT_API_URL, Prefect would dispatch into a temporary server of its own."""
    env = {k: v for k, v in clean_env(SCHED_ADMIN_TOKEN=ADMIN_TOKEN).items()
           if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile setting it either
    for args in (["serve"], ["serve", "--scheduler-only"]):
        result = run_cli(*args, "--port", str(free_port()), env=env)
        assert result.returncode == 2, result.stderr
        assert "PREFECT_API_URL" in result.stderr and "--api-only" in result.stderr


def test_serve_runs_api_and_central_scheduler_and_stops_both(tmp_path: Path) -> None:
    with serving(tmp_path, SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 PREFECT_API_URL=NO_PREFECT) as (base, log_path):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.get(f"{base}/api/tasks", headers=admin).json() == {"tasks": []}
        assert "central scheduler started" in log_path.read_text()
    log = log_path.read_text()
    assert "central scheduler stopped" in log
    assert log.index("central scheduler stopped") > log.index("Shutting down")
    assert "controller stopped" in log


def test_serve_scheduler_only_needs_no_token_and_stops_on_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [*CLI, "serve", "--scheduler-only"], cwd=ROOT,
            env=clean_env(SCHED_DATABASE_URL=url, PREFECT_API_URL=NO_PREFECT),
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "central scheduler started" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)  # polling for the process to come up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "central scheduler stopped" in log
    assert "Uvicorn running" not in log


def test_sched_console_script_has_the_controller_commands(tmp_path: Path) -> None:
    sched = Path(sys.executable).parent / "sched"
    path = tmp_path / "controller.db"
    result = subprocess.run(
        [str(sched), "controller", "migrate", "--database-url", f"sqlite:///{path}"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "agent_schedule" in tables(path)


def test_log_lines_carry_their_context_fields() -> None:
    """An operator reading the log sees which task failed, when, and why."""
    import logging
    from datetime import UTC, datetime

    from controller.cli import ContextFormatter

    record = logging.LogRecord("controller.central", logging.WARNING, __file__, 1,
                               "dispatch failed; will retry", (), None)
    record.__dict__.update(task_name="nightly", error="ValueError: no such 'x'",
                           scheduled_at=datetime(2026, 12, 2, 7, 30, tzinfo=UTC), attempts=2)
    line = ContextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == ("WARNING controller.central: dispatch failed; will retry task_name=nightly "
                    "error=\"ValueError: no such 'x'\" scheduled_at=2026-12-02T07:30:00+00:00 "
                    "attempts=2")
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "started", (), None)
    assert ContextFormatter("%(message)s").format(plain) == "started"
    access = logging.LogRecord("controller.access", logging.INFO, __file__, 1,
                               "GET /healthz node=- principal=- status=200 1.0ms", (), None)
    access.__dict__.update(method="GET", path="/healthz", status=200)  # already in the text
    assert ContextFormatter("%(message)s").format(access) == access.getMessage()


def test_log_lines_escape_what_a_client_chose() -> None:
    """A name holding a terminal escape or a newline cannot drive the terminal or forge a line."""
    import logging
    import sys as _sys

    from controller.cli import ContextFormatter

    record = logging.LogRecord("controller.api", logging.INFO, __file__, 1,
                               "task saved %s", ("t\x1b]0;owned\x07",), None)
    record.__dict__.update(task="x\x1b[2Jy", node="a\nINFO forged", other="\u202eevil")
    line = ContextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == ("INFO controller.api: task saved t\\x1b]0;owned\\x07 task=x\\x1b[2Jy "
                    "node='a\\nINFO forged' other=\\u202eevil")
    try:
        raise ValueError("bad \x1b[31mname\x1b[0m")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (),
                                   _sys.exc_info())
    text = ContextFormatter("%(message)s").format(failed)
    assert "\x1b" not in text and "bad \\x1b[31mname" in text
    assert text.count("\n") >= 2  # the traceback keeps its lines


def _write_tokens(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a tokens file as an operator should: a new file renamed over the old one."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    fresh.chmod(mode)
    fresh.replace(path)


def _wait_for_line(log_path: Path, text: str, count: int = 1) -> str:
    deadline = time.monotonic() + 60
    while (log := log_path.read_text()).count(text) < count:
        assert time.monotonic() < deadline, log
        time.sleep(0.05)  # polling the process's log for the line
    return log


def test_sighup_reloads_the_tokens_file_of_a_running_controller(tmp_path: Path) -> None:
    """Rotation without a restart: SIGHUP puts a new file in force; a broken one changes nothing."""
    tokens_file = tmp_path / "tokens.toml"
    _write_tokens(tokens_file, 'admin = "adm-old-1111"\n[nodes]\nnode-a = "na-old-1111"\n')
    # No looking at the file between signals: only SIGHUP can reload it here.
    with serving(tmp_path, "--api-only", "--tokens-check-interval", "0",
                 SCHED_TOKENS_FILE=str(tokens_file)) as (base, log_path):
        pid = _serve_pid(base)

        def status(token: str) -> int:
            return httpx.get(f"{base}/api/schedules?node=node-a",
                             headers={"Authorization": f"Bearer {token}"}).status_code

        assert (status("adm-old-1111"), status("na-old-1111"), status("adm-new-2222")) == (
            200, 200, 401)
        _write_tokens(tokens_file, 'admin = "adm-new-2222"\n[nodes]\nnode-a = "na-new-2222"\n')
        assert status("adm-old-1111") == 200  # not before the signal
        os.kill(pid, signal.SIGHUP)
        _wait_for_line(log_path, "tokens file reloaded")
        assert (status("adm-old-1111"), status("na-old-1111")) == (401, 401)
        assert (status("adm-new-2222"), status("na-new-2222")) == (200, 200)

        # A broken file: the last good tokens stay, the log says which file and why.
        _write_tokens(tokens_file, 'admin = "adm-broken-3333"\n[nodes\n')
        os.kill(pid, signal.SIGHUP)
        log = _wait_for_line(log_path, "not reloaded")
        assert f"tokens file {tokens_file} not reloaded; the tokens in force are kept" in log
        assert "is not valid .toml" in log
        _write_tokens(tokens_file, 'admin = "adm-open-4444"\n', mode=0o644)
        os.kill(pid, signal.SIGHUP)
        log = _wait_for_line(log_path, "not reloaded", count=2)
        assert "open to other users (group may read, others may read; mode 0644)" in log
        assert (status("adm-new-2222"), status("adm-broken-3333"), status("adm-open-4444")) == (
            200, 401, 401)
    log = log_path.read_text()
    for secret in ("adm-old-1111", "na-old-1111", "adm-new-2222", "na-new-2222",
                   "adm-broken-3333", "adm-open-4444"):
        assert secret not in log


def test_a_changed_tokens_file_is_reloaded_without_a_signal(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.json"
    _write_tokens(tokens_file, '{"admin": "adm-json-1"}')
    with serving(tmp_path, "--api-only", "--tokens-check-interval", "0.2",
                 SCHED_TOKENS_FILE=str(tokens_file)) as (base, log_path):
        _write_tokens(tokens_file, '{"admin": "adm-json-2"}')
        _wait_for_line(log_path, "tokens file reloaded")
        get = lambda token: httpx.get(  # noqa: E731
            f"{base}/api/nodes", headers={"Authorization": f"Bearer {token}"}).status_code
        assert (get("adm-json-1"), get("adm-json-2")) == (401, 200)


def test_serve_refuses_a_tokens_file_others_may_read(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.toml"
    _write_tokens(tokens_file, 'admin = "adm-open-5555"\n', mode=0o640)
    result = run_cli("serve", "--api-only", "--port", str(free_port()),
                     env=clean_env(SCHED_TOKENS_FILE=str(tokens_file),
                                   SCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}"))
    assert result.returncode == 2
    assert (f"error: tokens file {tokens_file} is open to other users (group may read; "
            f"mode 0640): chmod 600 {tokens_file}") in result.stderr
    assert "adm-open-5555" not in result.stdout + result.stderr


def make_self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """Return (certificate, key) PEM files for 127.0.0.1 and localhost, made here.

    With the ``cryptography`` package if installed, else with ``openssl``; else
    the test is skipped, saying why.
    """
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        import datetime as dt
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor openssl is installed: "
                        "no certificate to serve TLS with")
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60,
        )
        key.chmod(0o600)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(private.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
        ]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    key.chmod(0o600)
    return cert, key


def test_serve_over_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = make_self_signed_cert(tmp_path)
    with serving(tmp_path, "--api-only", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                 SCHED_ADMIN_TOKEN=ADMIN_TOKEN) as (base, log_path):
        assert base.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        put = httpx.put(f"{base}/api/nodes/node-a/schedules/s-1", json=SCHEDULE,
                        headers=admin, verify=trusted)
        assert put.status_code == 200, put.text
        assert httpx.get(f"{base}/api/nodes", headers=admin,
                         verify=trusted).json() == {"nodes": ["node-a"]}
        # A client that does not trust the certificate refuses it...
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{base}/healthz")
        # An agent's HTTP client (httpx, as the agent's pull uses) trusts it by SSL_CERT_FILE.
        pull = subprocess.run(
            [sys.executable, "-c", "import httpx, sys; print(httpx.Client().get(sys.argv[1], "
             "headers={'Authorization': 'Bearer ' + sys.argv[2]}).status_code)",
             f"{base}/api/schedules?node=node-a", ADMIN_TOKEN],
            env=clean_env(SSL_CERT_FILE=str(cert)), capture_output=True, text=True, timeout=60,
            check=False,
        )
        assert pull.stdout.strip() == "200", pull.stderr
        # ... and plain HTTP to the TLS port gets no HTTP answer (nor the token through).
        with pytest.raises(httpx.TransportError):
            httpx.get(base.replace("https://", "http://") + "/api/nodes", headers=admin)
    log = log_path.read_text()
    assert "tls=True" in log and "Uvicorn running on https://" in log
    assert ADMIN_TOKEN not in log


@pytest.mark.parametrize("case", ["key-only", "missing-cert", "wrong-key", "not-a-cert"])
def test_serve_refuses_tls_files_it_cannot_use_naming_them(tmp_path: Path, case: str) -> None:
    cert, key = make_self_signed_cert(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _other_cert, other_key = make_self_signed_cert(other)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    args, named = {
        "key-only": (["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
        "missing-cert": (["--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile",
                          str(key)], f"--ssl-certfile {tmp_path / 'nope.pem'}: cannot read it"),
        "wrong-key": (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
                      f"--ssl-certfile {cert} / --ssl-keyfile {other_key}: not a certificate "
                      "and key that belong together"),
        "not-a-cert": (["--ssl-certfile", str(junk), "--ssl-keyfile", str(key)],
                       f"--ssl-certfile {junk} / --ssl-keyfile {key}: not a certificate"),
    }[case]
    result = run_cli("serve", "--api-only", "--port", str(free_port()), *args,
                     env=clean_env(SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                                   SCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}"))
    assert result.returncode == 2, result.stderr
    assert f"error: {named}" in result.stderr


def test_serve_warns_at_start_up_when_its_prefect_api_does_not_answer(tmp_path: Path) -> None:
    """The real start-up path: the warning names the URL (no password) and the API still serves."""
    port = free_port()  # nothing listens there
    with serving(tmp_path, SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 PREFECT_API_URL=f"http://sched:pw-secret-77@127.0.0.1:{port}/api") as (
            base, log_path):
        log = _wait_for_line(log_path, "does not answer")
        assert httpx.get(f"{base}/api/tasks",
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
    line = next(x for x in log.splitlines() if "does not answer" in x)
    assert " WARNING controller.dispatch: the Prefect API at " in line, line
    assert f"the Prefect API at http://127.0.0.1:{port}/api does not answer (ConnectError" in line
    assert "tasks are dispatched once it does" in line
    assert "pw-secret-77" not in log_path.read_text()


def test_serve_says_when_its_prefect_api_answers(tmp_path: Path, prefect_server: str) -> None:
    with serving(tmp_path, SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 PREFECT_API_URL=prefect_server) as (_base, log_path):
        log = _wait_for_line(log_path, "the Prefect API answers")
    assert "does not answer" not in log


def test_serve_applies_its_connection_limits(tmp_path: Path) -> None:
    """The flags reach the running server: an idle connection gets the 408 of --header-timeout."""
    with serving(tmp_path, "--api-only", "--header-timeout", "1.5", "--max-connections", "50",
                 SCHED_ADMIN_TOKEN=ADMIN_TOKEN) as (base, _log_path):
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert answer.endswith(b"request headers not received within 1.5 s")


def test_serve_runs_the_fleet_watch_which_logs_a_dead_nodes_missed_window(
    tmp_path: Path,
) -> None:
    """`serve --watch-interval 1` (no Prefect API: the alert is logged): a node that never showed
    up, whose row was written an hour ago, has missed windows and is silent."""
    from datetime import UTC, datetime, timedelta

    from sqlmodel import Session

    from controller import schedules
    from controller.db import make_engine
    from sched_core.model import LocalSchedule

    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    engine = make_engine(url)
    with Session(engine) as session:
        schedules.put_schedule(session, "ghost", LocalSchedule.model_validate({
            "id": "bk", "name": "bk", "action": "backup", "miss_policy": "skip",
            "enabled": True, "schedule": {"interval_minutes": 15}}),
            now=datetime.now(UTC) - timedelta(hours=1))
    engine.dispose()
    with serving(tmp_path, "--api-only", "--watch-interval", "1",
                 SCHED_ADMIN_TOKEN=ADMIN_TOKEN) as (_base, log_path):
        log = _wait_for_line(log_path, "fleet alert", count=2)
    alerts = [x for x in log.splitlines() if " WARNING controller.watch: fleet alert" in x]
    assert {x.split(" kind=")[1].split()[0] for x in alerts} == {"window-missed", "node-silent"}
    assert all("node=ghost" in x for x in alerts)
    assert "reason='node ghost has never made a request to this controller" in log


def test_a_prefect_api_url_password_never_reaches_the_log(
    tmp_path: Path, prefect_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx's INFO request lines wrote PREFECT_API_URL whole, password too."""
    secret_url = prefect_server.replace("http://", "http://sched:pw-secret-99@")
    # Live: httpx logs each request's whole URL at INFO.
    caplog.set_level(logging.INFO, logger="httpx")
    assert httpx.get(f"{secret_url}/health", timeout=30).status_code == 200
    assert any("pw-secret-99" in r.getMessage() for r in caplog.records if r.name == "httpx")
    with serving(tmp_path, SCHED_ADMIN_TOKEN=ADMIN_TOKEN, PREFECT_API_URL=secret_url) as (
            base, log_path):
        _wait_for_line(log_path, "the Prefect API answers")
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        # A write sends its event through the same client: more requests, more chances.
        assert httpx.put(f"{base}/api/nodes/node-a/schedules/s-1", json=SCHEDULE,
                         headers=admin).status_code == 200
        _wait_for_line(log_path, "schedule write ")
    log = log_path.read_text()
    assert "pw-secret-99" not in log, log
    assert "HTTP Request:" not in log


def test_log_lines_never_carry_a_urls_password() -> None:
    from controller.cli import ContextFormatter

    formatter = ContextFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("httpx", logging.WARNING, __file__, 1,
                               "HTTP Request: GET %s", ("https://u:hunter2@h.example/api",), None)
    record.__dict__.update(url="postgresql://sched:pw2@db/sched")
    assert formatter.format(record) == (
        "WARNING httpx: HTTP Request: GET https://***@h.example/api url=postgresql://***@db/sched")


def test_serve_over_https_sends_hsts_and_warns_of_a_short_admin_token(tmp_path: Path) -> None:
    """Strict-Transport-Security over HTTPS; a 1-character token warned of."""
    cert, key = make_self_signed_cert(tmp_path)
    with serving(tmp_path, "--api-only", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                 SCHED_ADMIN_TOKEN="a") as (base, log_path):
        trusted = ssl.create_default_context(cafile=str(cert))
        for path in ("/healthz", "/api/nodes", "/"):
            answer = httpx.get(f"{base}{path}", verify=trusted)
            assert answer.headers["strict-transport-security"] == "max-age=31536000"
            assert answer.headers["x-content-type-options"] == "nosniff"
        # The token still works (a warning, not a refusal: existing set-ups keep running).
        assert httpx.get(f"{base}/api/nodes", headers={"Authorization": "Bearer a"},
                         verify=trusted).status_code == 200
    log = log_path.read_text()
    assert ("WARNING controller.auth: the admin token is 1 characters long, under the minimum "
            "of 16") in log, log
