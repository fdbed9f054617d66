"""The controller process's environment: one settings object, ``SCHED_*`` variables.

Rule: every environment variable the controller reads (``sched controller serve``
and ``migrate``; the flags are the command's own) is a field of
:class:`ControllerSettings`, read through pydantic-settings as the agent reads
its own (:mod:`sched_node.settings`). Names are exact (``SCHED_DATABASE_URL``; case
matters), an unset or empty variable is the default, and an invalid value is a
:class:`ConfigError` naming the variable. The whole set is checked at each
read, so a bad value stops any command that reads the environment.

Prefect's own variables (``PREFECT_API_URL``, ...) are Prefect's settings.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import SettingsConfigDict

from sched_core.errors import ConfigError
from sched_core.settings_sources import LayeredSettings

DEFAULT_RETRY_DELAY = 1.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str, name: str) -> tuple[Network, ...]:
    """Return the networks of a comma-separated list of addresses and CIDR networks.

    ``10.0.0.0/8``, ``127.0.0.1`` (one address), ``::1``; a bad item is a ValueError
    naming ``name`` and the item.
    """
    found: list[Network] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            found.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{name}: {item[:100]!r} is not an IP address or network "
                             "(e.g. 127.0.0.1 or 10.0.0.0/8)") from None
    return tuple(found)


def problems(exc: ValidationError, *, show_input: bool = True) -> str:
    """Return a ValidationError's problems in one line: our own messages as they are.

    A validator's own message (a ``ValueError``) already names what it is about;
    any other problem is prefixed by its field (or variable) and, with show_input,
    the value given (never for a setting that may hold a token).
    """
    said = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        if error["type"] == "value_error":
            said.append(str(error["ctx"]["error"]))
        elif show_input:
            said.append(f"{name}={error.get('input')!r}: {error['msg']}")
        else:
            said.append(f"{name}: {error['msg']}")
    return "; ".join(said)


class ControllerSettings(LayeredSettings):
    """What the controller reads from its environment: database, tokens, reconnect delay."""

    # Each field's variable is its alias, matched exactly (case matters), as before.
    model_config = SettingsConfigDict(
        case_sensitive=True, env_ignore_empty=True, extra="forbid", frozen=True,
        populate_by_name=True,
    )
    database_url: str = Field(
        "", validation_alias="SCHED_DATABASE_URL",
        json_schema_extra={"docs_default": "`.data/controller.db`"},
        description="the database, e.g. `postgresql://user:pw@host:5432/sched`; unset: the "
        "embedded SQLite file `.data/controller.db` under the working directory")
    admin_token: SecretStr = Field(
        SecretStr(""), validation_alias="SCHED_ADMIN_TOKEN",
        description="the **admin** token reads and writes everything; `serve` refuses to start "
        "without one unless you pass `--insecure-no-auth`")
    node_tokens: SecretStr = Field(
        SecretStr(""), validation_alias="SCHED_NODE_TOKENS",
        description="**node** tokens, `node-a=tok1,node-b=tok2`: each reads only that node's "
        "schedules")
    tokens_file: str = Field(
        "", validation_alias="SCHED_TOKENS_FILE",
        description="a tokens file (TOML, or JSON by its `.json` suffix), merged with the "
        "above; `chmod 600`; reloaded while `serve` runs (below)")
    trusted_proxies: str = Field(
        "", validation_alias="SCHED_TRUSTED_PROXIES",
        description="addresses or networks of the proxies in front (e.g. `127.0.0.1,10.0.0.0/8`) "
        "whose `X-Forwarded-For` names the client (the rightmost address that is not one of "
        "them) and whose `X-Forwarded-Proto` the scheme; none: the peer's address is the client "
        "and no header is believed")
    retry_delay: float = Field(
        DEFAULT_RETRY_DELAY, validation_alias="SCHED_RETRY_DELAY",
        description="seconds before the first reconnect of the listening connection (or retry "
        "of a failed pass) after a failure; doubles up to 30 s")

    @field_validator("retry_delay", mode="before")
    @classmethod
    def _check_retry_delay(cls, value: Any) -> Any:
        text = str(value).strip()
        if not text:
            raise PydanticUseDefault()
        name = cls.env_name("retry_delay")
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number of seconds") from None
        if not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"{name}={text!r} must be a positive number of seconds")
        return seconds

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _check_trusted_proxies(cls, value: Any) -> Any:
        parse_networks(str(value), cls.env_name("trusted_proxies"))
        return str(value)

    def proxy_networks(self) -> tuple[Network, ...]:
        """Return the trusted proxies as networks (a bare address is a network of one)."""
        return parse_networks(self.trusted_proxies, self.env_name("trusted_proxies"))

    @classmethod
    def env_name(cls, field: str) -> str:
        """Return the environment variable of a field (its alias)."""
        return str(cls.model_fields[field].validation_alias)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> ControllerSettings:
        """Return the settings from the environment (or environ); ConfigError naming a bad one."""
        # A given environment (a snapshot, a test's) is read instead of the process's.
        settings_cls: type[ControllerSettings] = cls if environ is None else type(
            cls.__name__, (cls,), {"_environ": dict(environ)})
        try:
            return settings_cls()
        except ValidationError as exc:
            raise ConfigError(problems(exc, show_input=False)) from None
