"""sched_core: schedules defined centrally, fired locally, with exact time semantics."""

from sched_core.chain import Chain, Spec, Stage
from sched_core.errors import ConfigError, PullError, SchedError, ScheduleError
from sched_core.matcher import DEFAULT_TZ, fire_times, last_fire, matches, next_fire, window_key
from sched_core.model import Cache, LocalSchedule, MissPolicy, Schedule
from sched_core.params import param_bool, param_int, param_string, param_strings
from sched_core.scheduler import Config, Fire, PullResult, Scheduler, TickReport

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
    "TickReport",
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
