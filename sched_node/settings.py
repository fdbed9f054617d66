"""The agent's configuration: one settings object from the environment and a TOML file.

Rule: every knob of the agent lives here, read once per flow run by
:func:`load_settings`. Sources, strongest first: keyword arguments, ``SCHED_*``
environment variables (nested with ``__``, e.g. ``SCHED_ACTIONS__BACKUP__TIMEOUT``),
the TOML file named by ``SCHED_CONFIG``, then the defaults below. Relative paths
(``state_dir``, a ``pull_url`` that is a plain path, an action's ``cwd``) are
resolved against the TOML file's folder, or the working directory without one.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self
from zoneinfo import ZoneInfo

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from sched_core import ConfigError
from sched_core.action_specs import ActionSpec, Seconds, StageSpec, action_of
from sched_core.matcher import DEFAULT_TZ, zone
from sched_core.settings_sources import LayeredSettings

log = logging.getLogger(__name__)

CONFIG_ENV = "SCHED_CONFIG"
"""The environment variable naming the TOML configuration file."""

def _octal(value: object) -> object:
    """Accept a umask as an int (TOML ``0o077``) or octal text (``"077"``, ``"0o077"``)."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError(f"{value!r} is not an octal umask such as \"077\"")
        return int(text, 8)
    return value


Umask = Annotated[int, BeforeValidator(_octal), Field(ge=0, le=0o777)]
"""A umask: an int (TOML ``0o077``) or octal text (``"077"``)."""

def _default_stages() -> list[StageSpec]:
    return [StageSpec(name="prune", action="prune"), StageSpec(name="check", action="check")]


class StateFile:
    """A file in the node's state folder, read like a property: ``settings.cache_path``."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.__doc__ = f"Return {what}: ``<state_dir>/{name}``."

    def __get__(self, settings: Any, owner: object = None) -> Path:
        return Path(settings.state_dir) / self.name


class AgentSettings(LayeredSettings):
    """Everything one agent node needs: where to pull, where to keep state, what to run."""

    model_config = SettingsConfigDict(
        env_prefix="SCHED_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    # One field a setting, each alike in shape (a type, a Field with its default and its
    # description, which the settings table in docs/ is made from): `duplicates` pairs some.
    node_name: str = Field(
        default_factory=socket.gethostname, min_length=1,
        json_schema_extra={"docs_default": "the host name"},
        description="the node; its deployments' names, the `node:` tag, the event resource")
    pull_url: str = Field(
        min_length=1,
        description="`https://.../api/schedules?node=N`, `file:///path.json`, or a plain path")
    token: SecretStr | None = Field(
        None,
        description="the controller's bearer token (never logged)")
    token_secret_block: str | None = Field(
        None,
        description="the name of a Prefect `Secret` block holding the token, used when `token` "
        "is unset (readable by anyone with the Prefect API: see section 2)")
    state_dir: Path = Field(
        Path(".state"),
        description="`cache.json`, `chain.json`, `outbox/`, `history.json`, `decided.json`, "
        "`plan.json`, `deployments.json`; created if missing, private (below)")
    timezone: str = Field(
        DEFAULT_TZ.key,
        description="the zone every schedule is matched in")
    grace: Seconds = Field(
        timedelta(minutes=5),
        description="how late a window may be decided after its start and still run (a node "
        "that was stopped); later ones go to the miss policy")
    # The planner: runs created ahead of their windows (docs/agent.md, "How the node
    # fires, and Prefect records").
    reconcile_interval: Seconds = Field(
        timedelta(minutes=15),
        description="seconds between the node's periodic pulls (a 304 from a controller); a "
        "change reaches the node at once through its long poll, so this is only the "
        "safety net; each also tops up the plan and asks Prefect for ad hoc runs "
        "it may have missed")
    plan_horizon: Seconds = Field(
        timedelta(hours=1),
        description="every window within this many seconds is a Scheduled run in Prefect (the "
        "Upcoming tab); must be longer than `reconcile_interval`. The plan is for "
        "the record: the node fires its windows whether it reached Prefect or not")
    plan_min_windows: int = Field(
        3, ge=0, le=100,
        description="and at least each schedule's next this many windows, within 8 days")
    plan_max_runs: int = Field(
        2000, ge=1,
        description="at most this many windows planned for the node, nearest first; the rest at "
        "the next reconcile")
    pull_timeout: Seconds = Field(
        timedelta(seconds=10),
        description="seconds per pull request")
    pull_retries: int = Field(
        3, ge=0,
        description="retries of a failed pull within one reconcile")
    pull_retry_delay: Seconds = Field(
        timedelta(seconds=2),
        description="the backoff factor: retries wait 2, 4, 8, ... seconds")
    # The node's report to the controller after each reconcile and job (sched_node/node_report.py).
    report_url: str | None = Field(
        None,
        json_schema_extra={"docs_default": "derived"},
        description="where the node reports its jobs and its heartbeat (below); default: the "
        "pull URL's `.../api/` prefix plus `nodes/<node>/report`; a file pull URL "
        "sends no report")
    report_timeout: Seconds = Field(
        timedelta(seconds=5),
        description="seconds a report may take; a failed report is sent again later and never "
        "holds up a job")
    wave: list[str] = Field(
        default_factory=lambda: ["backup", "copy"],
        json_schema_extra={"docs_env": "`SCHED_WAVE='[\"backup\",\"copy\"]'`"},
        description="the actions whose completion starts the chain")
    stages: list[StageSpec] = Field(
        default_factory=_default_stages,
        json_schema_extra={"docs_env": "(TOML)", "docs_default": "prune, then check"},
        description="`[[stages]]` with `name`, `action`, `on` (default `after_wave`), "
        "`trigger_key` (default `chain-<name>`), `after` (`success`, the default: "
        "the first stage follows only a wave in which a job succeeded; `any`)")
    wave_lookback: Seconds = Field(
        timedelta(hours=12),
        description="a wave is finished if one of its jobs ended within this many seconds")
    job_limit: int = Field(
        8, ge=1,
        description="how many jobs the node runs at once (running, or between two tries); the "
        "others wait in the order they came, one schedule's windows in order")
    listen: bool = Field(
        True,
        description="keep the node's one connection to the center (the controller's long poll, "
        "else Prefect's event stream) for changes, ad hoc runs and cancels; "
        "`false`: they arrive at the next `reconcile_interval`")
    heartbeat: Seconds = Field(
        timedelta(seconds=60),
        description="the longest the node stays silent to its controller (its long poll, or a "
        "report); 10 s to 1 h. The controller calls a node silent after a few of these")
    work_pool: str = Field(
        "sched-agent", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the Prefect work pool of the node's deployments: the node is one of its "
        "workers, its runs in a queue named after it; planned runs wait in its paused "
        "queue `planned` (created, a `process` pool, when missing)")
    worker_poll: Seconds = Field(
        timedelta(seconds=240),
        description="how often the node, as its pool's worker, looks at its queue when nothing "
        "woke it (a Run is taken at once when the node is woken); each look keeps its "
        "deployments Ready, on a server whose deployment and work-queue poll timeouts "
        "are longer than this (`PREFECT_SERVER_SERVICES_FOREMAN_*_LAST_POLLED_TIMEOUT_"
        "SECONDS`, docs/agent.md)")
    worker_heartbeat: Seconds = Field(
        timedelta(seconds=720),
        description="how often the node tells its pool it is alive (the Workers tab); Prefect "
        "shows it offline after three of these without one")
    ad_hoc_runs: Literal["prefect", "controller"] = Field(
        "prefect",
        description="who may make the node run or cancel a job between its windows: "
        "`prefect`, anyone with the Prefect API (the UI's Run, Retry and Cancel, like any "
        "worker); `controller`, only runs and cancels its controller vouches for (`sched "
        "run`, `sched cancel`; the UI's buttons are refused on the run, saying so), for a "
        "Prefect server shared with others (docs/agent-reference.md)")
    record_task_run: bool = Field(
        True,
        description="record each try of a job's command as a `run-command` task run (Running, "
        "then Completed or Failed); `false`: the tries are in the artifact and the "
        "output in the run's logs, 2 requests a job fewer (a large fleet: "
        "docs/scaled.md)")
    record_artifact: bool = Field(
        True,
        description="record each job's artifact (its tries' times and exit codes); `false`: "
        "one request a job fewer, the tries only in the run's logs and task run")
    outbox_max_bytes: int = Field(
        512 << 20, ge=1 << 20,
        description="past this size the outbox cuts the oldest unsent output to its last 100 "
        "lines (a long Prefect outage)")
    actions: dict[str, ActionSpec] = Field(
        default_factory=dict,
        json_schema_extra={"docs_env": "(TOML)"},
        description="the action table, below")

    # -- what a row may make a node execute (sched_core/render.py checks every value) --
    strict_params: bool = Field(
        True,
        description="a row may carry only the params its action declares (below); an action's "
        "own `strict_params` overrides it")
    job_umask: Umask = Field(
        0o077,
        json_schema_extra={"docs_default": "`0o077`"},
        description="the umask of every job's command (TOML `0o077`, env `077`): what it "
        "creates is the agent user's alone; also sets the state folder's mode")

    @field_validator("heartbeat")
    @classmethod
    def _check_heartbeat(cls, value: timedelta) -> timedelta:
        if not timedelta(seconds=10) <= value <= timedelta(hours=1):
            raise ValueError("heartbeat must be between 10 s and 1 h")
        return value

    @model_validator(mode="after")
    def _check_plan(self) -> Self:
        # Each reconcile must plan past the next one, or windows in between
        # would never get a run before they are due.
        if self.plan_horizon <= self.reconcile_interval:
            raise ValueError(
                f"plan_horizon ({self.plan_horizon.total_seconds():g} s) must be longer than "
                f"reconcile_interval ({self.reconcile_interval.total_seconds():g} s)"
            )
        return self

    @field_validator("timezone")
    @classmethod
    def _check_timezone(cls, value: str) -> str:
        zone(value)  # an unknown name is a ValueError naming it
        return value

    @field_validator("node_name")
    @classmethod
    def _check_node(cls, value: str) -> str:
        if "/" in value or value.strip() != value:
            raise ValueError(f"node_name {value!r} must not contain '/' or surrounding spaces")
        return value

    @property
    def tz(self) -> ZoneInfo:
        """Return the timezone all matching happens in."""
        return ZoneInfo(self.timezone)

    # The files the node keeps in its state folder.
    cache_path: ClassVar[StateFile] = StateFile("cache.json", "the schedule cache")
    marker_path: ClassVar[StateFile] = StateFile("chain.json", "the chain's day marker")
    plan_path: ClassVar[StateFile] = StateFile("plan.json", "the planner's record")
    deployments_path: ClassVar[StateFile] = StateFile("deployments.json", "the deployments' ids")

    def stage(self, trigger_key: str) -> StageSpec | None:
        """Return the chain stage whose fires carry trigger_key, or None."""
        return next((spec for spec in self.stages if spec.key() == trigger_key), None)

    def action(self, name: str) -> ActionSpec:
        """Return the action table entry for name, or raise ConfigError."""
        return action_of(self.actions, name)

    def bearer_token(self) -> str | None:
        """Return the controller's bearer token: the environment's, else the Secret block's."""
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_secret_block:
            from prefect.blocks.system import Secret

            value: Any = Secret.load(self.token_secret_block).get()  # type: ignore[union-attr]
            return str(value)
        return None


def _resolve(base: Path, path: Path) -> Path:
    return path if path.is_absolute() else (base / path).resolve()


def _resolve_pull_url(base: Path, url: str) -> str:
    if "://" in url:
        return url
    return _resolve(base, Path(url)).as_uri()


def load_settings(config: str | Path | None = None, *, create_state: bool = True,
                  **overrides: Any) -> AgentSettings:
    """Return the agent settings from config (default: ``$SCHED_CONFIG``), env and overrides.

    Raises ConfigError naming every invalid field; creates the state folder (unless
    create_state is false: ``sched agent check`` writes nothing).
    """
    path_text = str(config) if config is not None else os.environ.get(CONFIG_ENV, "")
    path = Path(path_text).expanduser().resolve() if path_text else None
    if path is not None and not path.is_file():
        raise ConfigError(f"configuration file {path} ({CONFIG_ENV}) does not exist")
    base = path.parent if path is not None else Path.cwd()
    settings_cls = type("AgentSettingsFromFile", (AgentSettings,), {"_toml_file": path})
    try:
        settings: AgentSettings = settings_cls(**overrides)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid agent settings{where}: {problems}") from exc
    except Exception as exc:  # a TOML syntax error surfaces here
        raise ConfigError(f"cannot read agent settings from {path}: {exc}") from exc
    settings.state_dir = _resolve(base, settings.state_dir)
    settings.pull_url = _resolve_pull_url(base, settings.pull_url)
    for spec in settings.actions.values():
        if spec.cwd is not None:
            spec.cwd = _resolve(base, spec.cwd)
        if spec.strict_params is None:
            spec.strict_params = settings.strict_params
        for rule in [*spec.params.values(), *spec.fields.values()]:
            if rule.under:
                rule.under = [_resolve(base, root) for root in rule.under]
    if create_state:
        make_private_dir(settings.state_dir, 0o777 & ~settings.job_umask)
    return settings


def make_private_dir(path: Path, mode: int) -> None:
    """Create path with mode (0700 under the default umask); tighten an existing one.

    An existing folder with bits beyond mode (a 0755 state folder from an older
    version) is chmod-ed to drop them, with a warning; if that fails (not its
    owner) the warning says so and the folder is used as it is.
    """
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        try:
            path.chmod(current & mode)
        except OSError as exc:
            log.warning(
                "state folder is readable by others and could not be tightened",
                extra={"path": str(path), "mode": oct(current), "error": str(exc)},
            )
            return
        log.warning(
            "state folder tightened",
            extra={"path": str(path), "was": oct(current), "now": oct(current & mode)},
        )
