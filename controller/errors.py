"""The controller's errors, under the kit's root :class:`sched_core.errors.SchedError`.

The tree (each also the built-in it resembles)::

    SchedError
    ├── ConfigError(ValueError)        sched_core: an invalid setting or environment value
    ├── NotFound(LookupError)          no such task, schedule or node row: HTTP 404
    ├── InvalidInput(ValueError)       a body, name or parameter refused: HTTP 422
    ├── BodyTooLarge(ValueError)       a request body over the limit: HTTP 413
    └── DispatchError(RuntimeError)    a claim could not be handed on (recorded, retried)
        └── DeploymentNotFound(LookupError)

:func:`controller.api.app.create_app` maps the HTTP ones to their status once.
"""

from __future__ import annotations

from typing import Any

from sched_core.errors import SchedError


class NotFound(SchedError, LookupError):
    """The named object does not exist."""


class InvalidInput(SchedError, ValueError):
    """The request was refused: ``detail`` lists each problem (field, loc, msg, type)."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(str(entry.get("msg", "")) for entry in detail) or None)
        self.detail = detail


class BodyTooLarge(SchedError, ValueError):
    """The request body is larger than the controller accepts."""


class DispatchError(SchedError, RuntimeError):
    """A claimed task could not be handed on to Prefect."""


class DeploymentNotFound(DispatchError, LookupError):
    """A deployment task names a deployment the Prefect server does not have."""
