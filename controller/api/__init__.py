"""The controller's HTTP API: the schedules agents pull, CRUD for schedules and tasks.

The package: :mod:`~controller.api.app` (the app, its error answers, the task routes),
:mod:`~controller.api.access` (auth as dependencies), :mod:`~controller.api.rows` (a
node's schedules: the pull and the writes), :mod:`~controller.api.fleet` (reports,
status, windows), :mod:`~controller.api.page` (the fleet page),
:mod:`~controller.api.jsonbody` (bodies read as Go reads them),
:mod:`~controller.api.pull` (the pull answer, its ETag and cache) and
:mod:`~controller.api.access_log` (one log line per request).

Rule: authentication runs before anything reads the request body, and every
answer about schedules is built from ``LocalSchedule.model_dump_json()`` (the
pull answer from each row's stored output of it, see :mod:`controller.schedules`),
so the bytes on the wire are the Go kit's JSON.

Endpoints: every ``/api`` one needs ``Authorization: Bearer <token>``. The list, with
who may call each, is the "Endpoints" table of docs/controller.md, which
``tests/test_api_reference.py`` checks against the OpenAPI document the app serves.

A missing or unknown token gets 401 with ``WWW-Authenticate: Bearer``; a node
token outside its node, or on a write, gets 403. An invalid body gets 422 with
``{"detail": [{"field": "schedule", "loc": [...], "msg": "...", "type": "..."}]}``,
and so does a node name, schedule id or task name that no database column holds
(over 200 characters, or with a NUL), on every path that takes one, so SQLite
and Postgres answer alike. A body is JSON as Go's ``encoding/json`` reads it: no
``NaN``/``Infinity`` and no number beyond a float64, nested at most 100 deep,
and its text fields hold no NUL (Postgres text cannot) and nothing but UTF-8.
"""

from controller.api.access_log import AccessLogMiddleware
from controller.api.app import create_app
from controller.api.pull import (
    PULL_CACHE_BYTES,
    PullCache,
    etag_header,
    etag_matches,
    schedules_body,
    wire_body,
)

__all__ = [
    "PULL_CACHE_BYTES",
    "AccessLogMiddleware",
    "PullCache",
    "create_app",
    "etag_header",
    "etag_matches",
    "schedules_body",
    "wire_body",
]
