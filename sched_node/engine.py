"""Runs the node hands to Prefect's engine, as a process worker would: ``python -m prefect.engine``.

A ``chain`` run taken from the node's queue is a flow that orchestrates other runs (each
stage's jobs are ``run-job`` subflow runs handed back to the node), so the node runs it the
way Prefect's process worker does: a process of its own, in a session of its own, with
``PREFECT__FLOW_RUN_ID`` and the node's door in its environment (``SCHED_NODE_SOCKET``), its
output in ``<state_dir>/engine/<run id>.log``. Its record is the engine's. A cancel stops the
process's group (SIGTERM), and the run is marked Cancelled. Prefect's engine is never in a
window's path: only runs that Prefect itself asked for go this way.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


class EngineRuns:
    """The engine processes the node started, by flow run id."""

    def __init__(self, folder: Path, env: Mapping[str, str]) -> None:
        self.folder = folder
        self.env = dict(env)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def start(self, run_id: str, name: str) -> None:
        """Run flow run run_id through Prefect's engine, in a process of its own."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "PREFECT__FLOW_RUN_ID": run_id}
        with open(self.folder / f"{run_id}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "prefect.engine"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        # Reaped by a thread of its own when it ends, whether the node still runs or not.
        threading.Thread(target=proc.wait, name=f"engine-{run_id}", daemon=True).start()
        with self._lock:
            self._procs = {key: item for key, item in self._procs.items()
                           if item.poll() is None}
            self._procs[run_id] = proc
        log.info("run %s (%s) goes to Prefect's engine (pid %d, log %s)", name, run_id,
                 proc.pid, self.folder / f"{run_id}.log")

    def running(self, run_id: str) -> bool:
        """Return whether the engine process of run_id still runs."""
        with self._lock:
            proc = self._procs.get(run_id)
        return proc is not None and proc.poll() is None

    def cancel(self, run_id: str) -> bool:
        """Stop the engine process of run_id (SIGTERM to its group); False when none runs."""
        with self._lock:
            proc = self._procs.get(run_id)
        if proc is None or proc.poll() is not None:
            return False
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True
