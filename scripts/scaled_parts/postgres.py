"""The scaled layout's Postgres cluster: made on first use, started, stopped."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

from scripts.scaled_parts.config import Layout, Tools
from scripts.scaled_parts.procs import SERVER_UMASK, LayoutError, say, start_time, tail


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
                              cwd=self.layout.dir, stdin=subprocess.DEVNULL, umask=SERVER_UMASK)

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
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
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
            log.touch(mode=0o600)
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
            password = self.layout.secret(f"pg_{db}")  # hex: checked, as it goes into SQL
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
