"""zbuf's torch.compile backend and its memory-budgeted all-gather scheduling.

The subpackage is itself callable: ``zbuf.compile(model, budget_bytes=None, prefetch=True,
persist=None, optimizer=None, recompute="checkpointed", ...)`` is
``compiled_model.compile_model``, while ``zbuf.compile.backend`` & co. stay importable modules
(the ``torch_dynamo_backends`` entry point names ``zbuf.compile.backend:zbuf_backend``).

- ``backend``: the backend; ``compiled_model``: ``compile_model``, the backend plus the step's
  measured memory; ``options``: ``CompileOptions``; ``budget``: the rank-agreed budget.
- ``passes``: the partitioner and schedule pass objects, ``PlanState``, the pass uuid.
- ``recompute``: which activations forward keeps and backward recomputes (the recompute modes,
  the budgeted plan checked on the partitioned graphs); ``recompute_plan``: its planner (pure).
- ``persist``: which gathered weights forward keeps for backward; ``graph_info``: FX graphs -> the planner's
  ``GraphSummary`` (``graph_model``); ``schedule``: the planner (pure).
- ``rewrite``: the plan into the graph (token, start / wait / release, reduce-scatter threading);
  ``collectives``: the graph ops it inserts; ``tied``: tied weights' reduce-scatters.
- ``fingerprint``: the cross-rank collective-order check; ``report``: schedule records.

The run-time side of the ops (pools, process groups, op counts) is ``zbuf.runtime``.
"""

from __future__ import annotations

import sys
import types

from .backend import zbuf_backend
from .compiled_model import compile_model, step_memory_of
from .budget import PlanExceedsMemoryError
from .fingerprint import ScheduleMismatchError
from .options import CompileOptions
from .report import ScheduleRecord, schedule_report

__all__ = [
    "compile_model",
    "step_memory_of",
    "zbuf_backend",
    "CompileOptions",
    "ScheduleMismatchError",
    "PlanExceedsMemoryError",
    "ScheduleRecord",
    "schedule_report",
]


class _CallableModule(types.ModuleType):
    def __call__(self, model, **kwargs):
        return compile_model(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
