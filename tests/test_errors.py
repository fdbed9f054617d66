"""The controller's error tree sits under the kit's root and the built-ins it resembles."""

from __future__ import annotations

import pytest

from controller.errors import (
    BodyTooLarge,
    DeploymentNotFound,
    DispatchError,
    InvalidInput,
    NotFound,
)
from sched_core.errors import SchedError


@pytest.mark.parametrize(
    ("error", "builtin"),
    [(NotFound, LookupError), (InvalidInput, ValueError), (BodyTooLarge, ValueError),
     (DispatchError, RuntimeError), (DeploymentNotFound, LookupError)],
)
def test_each_error_is_a_sched_error_and_its_builtin(error: type, builtin: type) -> None:
    assert issubclass(error, SchedError) and issubclass(error, builtin)


def test_invalid_input_keeps_its_entries_and_says_them() -> None:
    entries = [{"field": "cron", "loc": ["body", "cron"], "msg": "bad cron", "type": "x"}]
    error = InvalidInput(entries)
    assert error.detail == entries and str(error) == "bad cron"
    assert str(NotFound()) == "The named object does not exist."
    assert issubclass(DeploymentNotFound, DispatchError)
