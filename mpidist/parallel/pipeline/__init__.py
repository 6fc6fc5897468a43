"""Pipeline parallelism: schedules as data (schedules.py) and the executor that runs them (executor.py)."""

from .executor import SCHEDULES, Pipeline, StepStats
from .schedules import (Action, ScheduleDeadlockError, Kind, Schedule, SimResult, format_grid, gpipe, insert_comms,
                        interleaved_1f1b, one_f_one_b, simulate_schedule, validate, zero_bubble_h1)

__all__ = [
    "Pipeline", "StepStats", "SCHEDULES",
    "Kind", "Action", "Schedule", "SimResult", "ScheduleDeadlockError",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1",
    "insert_comms", "validate", "simulate_schedule", "format_grid",
]
