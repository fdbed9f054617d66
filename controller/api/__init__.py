"""The controller's HTTP API: the schedules agents pull, CRUD for schedules and tasks.

The package: :mod:`~controller.api.app` (the app, its error answers, the task routes),
:mod:`~controller.api.access` (auth as dependencies), :mod:`~controller.api.rows` (a
node's schedules: the pull and the writes), :mod:`~controller.api.fleet` (reports,
status, windows), :mod:`~controller.api.page` (the fleet page),
:mod:`~controller.api.jsonbody` (bodies read as Go reads them),
:mod:`~controller.api.pull` (the pull answer, its ETag and cache) and
:mod:`~controller.api.access_log` (one log line per request).

Rule: authentication runs before anything reads the request body, and every answer about
schedules is built from ``LocalSchedule.model_dump_json()`` (see :mod:`controller.schedules`),
so the bytes on the wire are the Go kit's JSON. Every ``/api`` endpoint needs
``Authorization: Bearer <token>``; the list, with who may call each, is the "Endpoints"
table of docs/controller.md, checked against the app's OpenAPI document by
``tests/test_api_reference.py``.
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
