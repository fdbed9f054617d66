"""The node's local door: where a flow that Prefect's engine runs on this host hands the node a job.

When Prefect runs one of the flows in ``flows/`` (a worker, ``prefect flow-run execute``,
``run_deployment``, a call in Python), the flow does not run the command itself: it asks the
node on its host, through this door, and follows the job to its end. So a job started by
Prefect passes the same start guard, job slots, overlap rule and repository lock as a
window's job, and runs only what the node's action table renders from its own cache.

The door is HTTP over a Unix socket, ``<state_dir>/node.sock``, created 0600 in the node's
private state folder: only the node's own user (or root) reaches it. Nothing on the network
does. Requests and answers are JSON:

=================================  ==========================================================
``GET /node``                      the node's name, its cached schedules (id, name, action,
                                   ``on``) and its chain's stages
``POST /jobs``                     ``{"schedule_id", "flow_run_id", "flow_run_name"}``: run the
                                   cached schedule now, recorded by the engine that asks;
                                   answers ``{"job_id"}`` (201), 404 naming the known ids
``GET /jobs/<id>?after=&wait=``    the job now (phase, state, message, error, tries) and its
                                   lines after the cursor ``after``, waiting up to ``wait`` s
                                   (at most :data:`MAX_WAIT_S`) for news
``POST /jobs/<id>/recorded``       the engine recorded the job's end: the node need not
``POST /reconcile``                ``{"flow_run_id"}``: pull and plan now; answers the summary
=================================  ==========================================================

A socket path longer than the kernel takes (108 bytes; a deep state folder) is reached through
``/proc/self/fd/<fd of the folder>``: :func:`socket_path` gives the short name on both sides.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sched_core.action_specs import StageSpec
from sched_core.model import LocalSchedule
from sched_node.settings import CONFIG_ENV

log = logging.getLogger(__name__)

SOCKET_NAME = "node.sock"
DOOR_KEY_ENV = "SCHED_DOOR_KEY"
"""The variable that gives the node's own engine processes the door's key."""
DOOR_KEY_HEADER = "X-Sched-Door-Key"
MAX_WAIT_S = 30.0
"""The longest a ``GET /jobs/<id>`` holds its answer waiting for news."""
MAX_BODY = 64 * 1024
"""The largest request body the door reads."""
MAX_LINES = 500
"""Lines in one answer (the follower asks again from its cursor)."""
_UNIX_PATH_MAX = 100


@contextmanager
def socket_path(path: Path) -> Iterator[str]:
    """Yield a name of the socket at path that ``bind`` and ``connect`` take (short enough)."""
    text = str(path)
    if len(text.encode()) < _UNIX_PATH_MAX:
        yield text
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def describe(node: str, schedules: list[LocalSchedule],
             stages: list[StageSpec]) -> dict[str, Any]:
    """Return the node's name, cached schedules and chain stages (``GET /node``)."""
    return {"node": node,
            "schedules": [{"id": row.id, "name": row.name, "action": row.action,
                           "on": row.schedule.on or None, "enabled": row.enabled}
                          for row in schedules],
            "stages": [{"name": stage.name, "action": stage.action, "on": stage.on}
                       for stage in stages]}


def flow_run_env(state_dir: Path) -> dict[str, str]:
    """Return what a flow run Prefect's engine runs on this host needs to find the node: the
    agent config's path (``SCHED_CONFIG``), else the door's (``SCHED_NODE_SOCKET``)."""
    door = {"SCHED_NODE_SOCKET": str((state_dir / SOCKET_NAME).resolve())}
    config = os.environ.get(CONFIG_ENV)
    return {CONFIG_ENV: str(Path(config).resolve()), **door} if config else door


@dataclass(frozen=True)
class Door:
    """What the node does for the door (the node gives its own hands)."""

    node: Callable[[], dict[str, Any]]
    """The node's name, schedules and stages (``GET /node``)."""
    submit: Callable[[str, str | None, str | None, str | None], tuple[str | None, str]]
    """Run a cached schedule now for an engine's run (its name, id and the door key it
    brings): (job id, "") or (None, why not)."""
    job: Callable[[str, str, float], dict[str, Any] | None]
    """A job now and its lines after a cursor, waiting up to a time for news; None: no job."""
    recorded: Callable[[str], bool]
    """The engine recorded the job's end; False: no such job."""
    reconcile: Callable[[str | None], dict[str, Any]]
    """Pull and plan now; the summary."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("local door: " + format, *args)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any] | None:
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            size = -1
        if size < 0 or size > MAX_BODY:
            self._answer(413, {"error": f"a body of at most {MAX_BODY} bytes"})
            return None
        try:
            data = json.loads(self.rfile.read(size) or b"{}")
        except ValueError:
            self._answer(400, {"error": "the body is not JSON"})
            return None
        if not isinstance(data, dict):
            self._answer(400, {"error": "the body is not a JSON object"})
            return None
        return data

    def do_GET(self) -> None:
        door = self.server.door
        url = urlsplit(self.path)
        parts = [part for part in url.path.split("/") if part]
        if parts == ["node"]:
            self._answer(200, door.node())
            return
        if len(parts) == 2 and parts[0] == "jobs":
            query = parse_qs(url.query)
            cursor = (query.get("after") or [""])[0]
            try:
                wait = min(max(float((query.get("wait") or ["0"])[0]), 0.0), MAX_WAIT_S)
            except ValueError:
                wait = 0.0
            found = door.job(parts[1], cursor, wait)
            if found is None:
                self._answer(404, {"error": f"no job {parts[1]!r} on this node"})
            else:
                self._answer(200, found)
            return
        self._answer(404, {"error": f"no {url.path} here"})

    def do_POST(self) -> None:
        door = self.server.door
        parts = [part for part in urlsplit(self.path).path.split("/") if part]
        body = self._body()
        if body is None:
            return
        if parts == ["jobs"]:
            schedule_id = body.get("schedule_id")
            run_id, run_name = body.get("flow_run_id"), body.get("flow_run_name")
            if not isinstance(schedule_id, str) or not schedule_id:
                self._answer(400, {"error": "schedule_id: the cached schedule to run"})
                return
            job_id, why = door.submit(schedule_id, run_id if isinstance(run_id, str) else None,
                                      run_name if isinstance(run_name, str) else None,
                                      self.headers.get(DOOR_KEY_HEADER))
            if job_id is None:
                self._answer(404, {"error": why})
            else:
                self._answer(201, {"job_id": job_id})
            return
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "recorded":
            ok = door.recorded(parts[1])
            self._answer(200 if ok else 404, {"ok": ok})
            return
        if parts == ["reconcile"]:
            run_id = body.get("flow_run_id")
            self._answer(200, door.reconcile(run_id if isinstance(run_id, str) else None))
            return
        self._answer(404, {"error": f"no {self.path} here"})


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    door: Door


class LocalDoor:
    """The door, served in a thread of the node until stopped."""

    def __init__(self, state_dir: Path, door: Door) -> None:
        self.path = state_dir / SOCKET_NAME
        self.door = door
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LocalDoor:
        """Open the socket (0600; a stale one from a killed node is replaced) and serve."""
        try:
            self.path.unlink(missing_ok=True)
            old = os.umask(0o177)
            try:
                with socket_path(self.path) as name:
                    server = _Server(name, _Handler)
            finally:
                os.umask(old)
        except OSError as exc:
            log.error("the node's local door %s cannot open (flows that Prefect runs on this "
                      "host cannot hand the node a job): %s", self.path, exc)
            return self
        server.door = self.door
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="local-door",
                                        kwargs={"poll_interval": 1.0}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and remove the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.path.unlink(missing_ok=True)


def wait_for(check: Callable[[], bool], wait_s: float, step: float = 0.2) -> None:
    """Sleep until check() holds or wait_s passed (a door's long poll)."""
    deadline = time.monotonic() + wait_s
    while not check() and time.monotonic() < deadline:
        time.sleep(min(step, max(deadline - time.monotonic(), 0.0)))


class NodeUnreachable(ConnectionError):
    """No node answers at the door (none runs on this host, or it is restarting)."""


class NodeLink:
    """The flows' side of the door: one node's socket, asked over HTTP (the module's table)."""

    def __init__(self, path: Path, *, timeout: float = MAX_WAIT_S + 15) -> None:
        import httpx

        self.path = path
        self._fd: int | None = None
        name = str(path)
        if len(name.encode()) >= _UNIX_PATH_MAX:
            self._fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            name = f"/proc/self/fd/{self._fd}/{path.name}"
        key = os.environ.get(DOOR_KEY_ENV)
        self._client = httpx.Client(transport=httpx.HTTPTransport(uds=name),
                                    base_url="http://node", timeout=timeout,
                                    headers={DOOR_KEY_HEADER: key} if key else None)

    def close(self) -> None:
        """Close the connection and the folder handle."""
        self._client.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _call(self, method: str, url: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        import httpx

        try:
            response = self._client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise NodeUnreachable(f"no node answers at {self.path} ({type(exc).__name__}: "
                                  f"{exc})") from None
        try:
            data = response.json()
        except ValueError:
            data = {"error": response.text[:300]}
        return response.status_code, data if isinstance(data, dict) else {"value": data}

    def node(self) -> dict[str, Any]:
        """Return the node's name, schedules and stages."""
        return self._call("GET", "/node")[1]

    def submit(self, schedule_id: str, *, flow_run_id: str | None,
               flow_run_name: str | None) -> tuple[str | None, str]:
        """Hand the node a job; return (its id, "") or (None, the node's reason)."""
        status, data = self._call("POST", "/jobs", json={
            "schedule_id": schedule_id, "flow_run_id": flow_run_id,
            "flow_run_name": flow_run_name})
        if status == 201:
            return str(data["job_id"]), ""
        return None, str(data.get("error") or f"the node answered {status}")

    def job(self, job_id: str, after: str, wait: float) -> dict[str, Any] | None:
        """Return the job now and its lines after the cursor; None when the node has no such
        job."""
        status, data = self._call("GET", f"/jobs/{job_id}",
                                  params={"after": after, "wait": f"{wait:g}"})
        return data if status == 200 else None

    def recorded(self, job_id: str) -> None:
        """Tell the node the engine recorded the job's end."""
        self._call("POST", f"/jobs/{job_id}/recorded", json={})

    def reconcile(self, flow_run_id: str | None) -> dict[str, Any]:
        """Ask the node to pull and plan now; return its summary."""
        return self._call("POST", "/reconcile", json={"flow_run_id": flow_run_id})[1]
