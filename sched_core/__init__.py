"""sched_core: schedules defined centrally, fired locally, with exact time semantics.

The pure names (model, matcher, params, errors) load with the package; the
shell (``Scheduler``, ``Chain`` and their helpers, which pull over HTTP, write
files and run threads) loads on first use, so a user of the matcher alone
never imports httpx or the state-file machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sched_core.errors import ConfigError, PullError, SchedError, ScheduleError, WireError
from sched_core.matcher import DEFAULT_TZ, fire_times, last_fire, matches, next_fire, window_key
from sched_core.model import Cache, LocalSchedule, MissPolicy, Schedule
from sched_core.params import param_bool, param_int, param_string, param_strings
from sched_core.values import check_identifier

if TYPE_CHECKING:
    from sched_core.chain import Chain, Spec, Stage
    from sched_core.config import Config, Fire, TurnReport
    from sched_core.scheduler import PullResult, Scheduler

_LAZY = {
    "Chain": "sched_core.chain",
    "Spec": "sched_core.chain",
    "Stage": "sched_core.chain",
    "Config": "sched_core.config",
    "Fire": "sched_core.config",
    "PullResult": "sched_core.scheduler",
    "Scheduler": "sched_core.scheduler",
    "TurnReport": "sched_core.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sched_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_TZ",
    "Cache",
    "Chain",
    "Config",
    "ConfigError",
    "Fire",
    "LocalSchedule",
    "MissPolicy",
    "PullError",
    "PullResult",
    "SchedError",
    "Schedule",
    "ScheduleError",
    "Scheduler",
    "Spec",
    "Stage",
    "TurnReport",
    "WireError",
    "check_identifier",
    "fire_times",
    "last_fire",
    "matches",
    "next_fire",
    "param_bool",
    "param_int",
    "param_string",
    "param_strings",
    "window_key",
]
