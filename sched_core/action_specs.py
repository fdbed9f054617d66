"""The action table's models: what a row may make a node execute, and the chain's stages.

An action (:class:`ActionSpec`) is an argv of templates (``{repo_id}``,
``{param:NAME}``, ``{state_dir}``, ...) with its timeout, retries, working folder
and declared parameters (:class:`ParamSpec`, each with its rule);
:mod:`sched_core.render` checks every value against them before a command runs (on
the node) and when a row is written (on the controller, against the node's published table).
The agent's settings hold the table, read from TOML.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from sched_core import ConfigError

TEMPLATE_FIELDS = frozenset(
    {"repo_id", "storage", "param", "state_dir", "node", "schedule_id", "action", "window",
     "trigger_key"}
)
"""Names an argv template may use: ``{repo_id}``, ``{param:NAME}``, ``{window}``, ..."""


def template_pieces(template: str) -> list[tuple[str, str | None, str, str | None]]:
    """Return a template's (literal, field, spec, conversion) pieces; ValueError when malformed.

    The one parse of an argv template: :func:`template_fields` checks its fields at load,
    :func:`sched_core.render.render_argv` fills them.
    """
    return [
        (literal, name, spec or "", conv)
        for literal, name, spec, conv in string.Formatter().parse(template)
    ]


def template_fields(template: str) -> list[tuple[str, str]]:
    """Return the (field, spec) pairs of a template; ``{param:threads}`` gives ("param", "threads").

    Raises ConfigError on a malformed template or an unknown field. ``{{`` and
    ``}}`` are literal braces (``find ... -exec gzip -t {{}} +``).
    """
    try:
        parsed = template_pieces(template)
    except ValueError as exc:
        raise ConfigError(f"argv template {template!r} is malformed: {exc}") from exc
    fields: list[tuple[str, str]] = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if conversion or name not in TEMPLATE_FIELDS:
            raise ConfigError(
                f"argv template {template!r} names unknown field {{{name}}} "
                f"(known: {', '.join(sorted(TEMPLATE_FIELDS - {'param'}))}, param:NAME)"
            )
        if name == "param" and not spec:
            raise ConfigError(f"argv template {template!r}: {{param}} needs a name, {{param:NAME}}")
        if name != "param" and spec:
            raise ConfigError(f"argv template {template!r}: {{{name}:{spec}}} takes no spec")
        fields.append((name, spec or ""))
    return fields


def _seconds(value: object) -> object:
    """Accept a number of seconds, also as text (environment variables are text)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


Seconds = Annotated[timedelta, BeforeValidator(_seconds)]
"""A duration given as seconds (``300``, ``"0.5"``) or ISO 8601 (``"PT5M"``)."""


MAX_VALUE_BYTES = 4096
"""The longest value (in UTF-8 bytes) a row may put into one argv element."""

ROW_FIELDS = ("repo_id", "storage", "schedule_id", "action", "node", "trigger_key")
"""The placeholders other than ``{param:NAME}`` whose values an action may declare."""

class ParamSpec(BaseModel):
    """What one value may be: ``[actions.backup.params.path] type = "path", under = [...]``.

    ``string``: text, optionally one of ``choices`` or matching ``pattern`` (the
    whole value, Python ``re``), at most ``max_length`` characters; it may start
    with ``-`` only with ``allow_dash = true``, which needs ``pattern`` or
    ``choices``. ``int``: a whole number within ``min``/``max``. ``bool``:
    true or false (written ``true``/``false``). ``path``: an absolute path, or
    one relative to the action's ``cwd``, that (normalised, symlinks resolved)
    stays under one of the ``under`` roots; the command gets the resolved path.
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["string", "int", "bool", "path"]
    pattern: str | None = None
    choices: list[str] | None = None
    allow_dash: bool = False
    max_length: int | None = Field(default=None, ge=1, le=MAX_VALUE_BYTES)
    min: int | None = None
    max: int | None = None
    under: list[Path] | None = None

    @model_validator(mode="after")
    def _check_rule(self) -> Self:
        only = {"pattern": "string", "choices": "string", "allow_dash": "string",
                "max_length": "string", "min": "int", "max": "int", "under": "path"}
        for key, kind in only.items():
            if key in self.model_fields_set and self.type != kind:
                raise ValueError(f"{key} applies to type = {kind!r} only, not {self.type!r}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regex: {exc}") from exc
        if self.choices is not None and not self.choices:
            raise ValueError("choices is empty: list the values allowed")
        if self.allow_dash and self.pattern is None and self.choices is None:
            raise ValueError(
                "allow_dash needs a pattern or choices: a value that may start with '-' "
                "becomes an option of the command, so say which ones"
            )
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        if self.type == "path" and not self.under:
            raise ValueError('type = "path" needs under = ["/root/it/must/stay/in", ...]')
        return self


class ActionSpec(BaseModel):
    """How to run one action: an argv template, executed without a shell.

    ``params`` declares the row's ``params`` the action takes (a ParamSpec
    each), ``fields`` adds rules for row fields (``storage``, ``repo_id``, ...);
    with ``strict_params`` (None: the agent's setting, true by default) a row
    with a param not declared here fails the job.
    """

    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(min_length=1)
    timeout: Seconds = timedelta(hours=6)
    retries: int = Field(default=0, ge=0)
    retry_delay: Seconds = timedelta(seconds=30)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: Path | None = None
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    fields: dict[str, ParamSpec] = Field(default_factory=dict)
    strict_params: bool | None = None

    @field_validator("argv")
    @classmethod
    def _check_templates(cls, argv: list[str]) -> list[str]:
        for item in argv:
            template_fields(item)
        if template_fields(argv[0]):
            raise ValueError(
                f"argv[0] {argv[0]!r} must be a fixed program, not a template: "
                "a row must never choose what runs"
            )
        return argv

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, fields: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
        for name, rule in fields.items():
            if name not in ROW_FIELDS:
                raise ValueError(
                    f"{name!r} is no row field an argv template names "
                    f"(one of {', '.join(ROW_FIELDS)}; declare params under params)"
                )
            if rule.type not in ("string", "path"):
                raise ValueError(f"{name}: a row field is text: type string or path")
        return fields

    @model_validator(mode="after")
    def _check_state_paths(self) -> Self:
        # A value inside {state_dir}/... may hold no '/', so a path rule there never passes.
        for item in self.argv:
            names = template_fields(item)
            if ("state_dir", "") not in names:
                continue
            for field, spec in names:
                label = f"param:{spec}" if field == "param" else field
                rule = self.rule(label)
                if rule is not None and rule.type == "path":
                    raise ValueError(
                        f"argv element {item!r}: {{{label}}} is declared a path, but a value "
                        "inside a {state_dir} path may hold no '/'"
                    )
        return self

    def rule(self, label: str) -> ParamSpec | None:
        """Return the declared rule of a placeholder (``param:path``, ``storage``), if any."""
        if label.startswith("param:"):
            return self.params.get(label.removeprefix("param:"))
        return self.fields.get(label)


def action_of(actions: Mapping[str, ActionSpec], name: str) -> ActionSpec:
    """Return the table's entry for name, or raise ConfigError naming the known ones."""
    try:
        return actions[name]
    except KeyError:
        known = ", ".join(sorted(actions)) or "none"
        raise ConfigError(f"no action {name!r} in the action table (known: {known})") from None


class StageSpec(BaseModel):
    """One chain stage: fires the ``on`` schedules of its action after the previous stage."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    action: str = Field(min_length=1)
    on: str = "after_wave"
    trigger_key: str = ""
    after: Literal["success", "any"] = "success"
    """What the stage follows: ``success`` (the default) fires it only after a wave (for the
    first stage) in which at least one job succeeded; ``any`` after any wave that drained."""

    def key(self) -> str:
        """Return the trigger key the stage's fires carry (default ``chain-<name>``)."""
        return self.trigger_key or f"chain-{self.name}"
