"""sched_core: schedules defined centrally, fired locally, with exact time semantics."""

from sched_core.errors import ConfigError, PullError, SchedError, ScheduleError
from sched_core.model import Cache, LocalSchedule, MissPolicy, Schedule
from sched_core.params import param_bool, param_int, param_string, param_strings

__all__ = [
    "Cache",
    "ConfigError",
    "LocalSchedule",
    "MissPolicy",
    "PullError",
    "SchedError",
    "Schedule",
    "ScheduleError",
    "param_bool",
    "param_int",
    "param_string",
    "param_strings",
]
