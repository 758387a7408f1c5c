"""The step's memory, in one house: what the device has, what torch, the pool and the optimizer
hold, what every rank agrees on, and the only writer of the pool's budget ([Note: one writer of
the pool's budget] in pool_budget.py). ``zbuf.compile`` asks it; it never plans a graph.
"""

from . import pool_budget
from .agreement import agree_extremes, stable_budget, stable_bytes, stable_free_memory
from .device import (host_bytes, host_core_share, host_cores, host_share_bytes, local_free_bytes,
                     user_capacity_bytes)
from .ledger import Ledger
from .optimizer_state import OptimizerPolicy
from .phases import PhaseMeter, StepPhases, StepProfile
from .planner import PlanPhase, PlanPhases, Replan, StructurePlanner
from .shared import MemoryEvents, SharedMemory, expand_torch_segments, users_allocator_settings
from .step import MeasuredBudget, StepMemory, StepMemoryRow

__all__ = ["pool_budget", "agree_extremes", "stable_budget", "stable_bytes",
           "stable_free_memory", "host_bytes", "host_core_share", "host_cores", "host_share_bytes",
           "local_free_bytes",
           "user_capacity_bytes",
           "Ledger", "OptimizerPolicy", "PhaseMeter", "StepPhases", "StepProfile", "PlanPhase",
           "PlanPhases", "Replan", "StructurePlanner", "MemoryEvents", "SharedMemory",
           "users_allocator_settings", "expand_torch_segments",
           "MeasuredBudget", "StepMemory", "StepMemoryRow"]
