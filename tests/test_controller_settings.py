"""The controller's environment (ControllerSettings): exact names, empty is unset, checked."""

from __future__ import annotations

import pytest

from controller.auth import Tokens
from controller.central import CentralSettings
from controller.db import database_url
from controller.settings import ControllerSettings
from sched_core.errors import ConfigError


def test_the_variables_are_read_by_their_exact_names(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SCHED_DATABASE_URL", "SCHED_RETRY_DELAY", "SCHED_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("sched_retry_delay", "7")  # another name: not read
    monkeypatch.setenv("SCHED_ADMIN_TOKEN", "")  # empty: unset
    settings = ControllerSettings.read()
    assert settings.retry_delay == 1.0 and settings.admin_token.get_secret_value() == ""
    monkeypatch.setenv("SCHED_RETRY_DELAY", " 0.5 ")
    monkeypatch.setenv("SCHED_DATABASE_URL", "postgresql://u@h/sched")
    assert ControllerSettings.read().retry_delay == 0.5
    assert CentralSettings.from_env().retry_delay == 0.5
    assert str(database_url()) == "postgresql+psycopg://u@h/sched"
    assert "0.5" not in repr(ControllerSettings.read(
        {"SCHED_ADMIN_TOKEN": "0.5-secret"}))  # a token is never in a repr


def test_a_given_environment_is_read_instead_of_the_process_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHED_ADMIN_TOKEN", "from-the-process-" + "x" * 16)
    monkeypatch.setenv("SCHED_RETRY_DELAY", "soon")  # not in the given one: not read
    tokens = Tokens.from_env({"SCHED_NODE_TOKENS": "node-a=" + "t" * 20})
    assert not tokens.has_admin
    assert ControllerSettings.read({"SCHED_RETRY_DELAY": "  "}).retry_delay == 1.0


@pytest.mark.parametrize(("value", "said"), [
    ("soon", "SCHED_RETRY_DELAY='soon' is not a number of seconds"),
    ("0", "SCHED_RETRY_DELAY='0' must be a positive number of seconds"),
    ("nan", "SCHED_RETRY_DELAY='nan' must be a positive number of seconds"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable(value: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ControllerSettings.read({"SCHED_RETRY_DELAY": value})
    assert str(caught.value) == said
    with pytest.raises(ConfigError, match="SCHED_RETRY_DELAY"):
        Tokens.from_env({"SCHED_RETRY_DELAY": value})  # the environment is checked whole
