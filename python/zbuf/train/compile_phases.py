"""Where the first step's time goes: torch's own compile timers, cut into exclusive phases.

[Note: compile phases]
torch 2.11 times its compile stages with ``dynamo_timed``, which appends every span's duration
to ``torch._dynamo.utils.compilation_time_metrics`` (key -> list of seconds); zbuf's passes use
the same timer (keys ``zbuf.*``, see ``ZBUF_KEYS``), so one source covers both. The spans nest,
so the phases below are differences of spans, measured on the rank's main thread, and they add
up to the first step's wall time exactly:

- ``dynamo``: ``_compile.compile_inner`` (a frame's whole compile) less
  ``OutputGraph.call_user_compiler`` (the backend): bytecode tracing, guards, graph fix-ups.
- ``aot``: what is left of the backend and of ``backward._backward_impl`` (the lazily compiled
  backward) once the phases below are taken out: AOTAutograd's metadata pass, the joint graph,
  the partitioner (min-cut), joint-graph passes, and an AOTAutograd cache lookup or load.
- ``zbuf``: zbuf's own passes (recompute tags on the joint graph; plan, rewrite and fingerprint
  of the forward and backward graphs).
- ``inductor``: ``compile_fx_inner`` less the kernel compile waits and the zbuf post-grad pass:
  Inductor's other post-grad passes, lowering, scheduling and fusion, code generation.
- ``kernel_compile``: time the main thread waits for Triton/C++ kernel compilation
  (``async_compile.wait``, or the compiles themselves with one compile thread) and Triton
  autotuning at the first launch. Compiles that finish while the main thread is still
  generating code are hidden behind ``inductor``; ``kernel_compile_work_s`` sums them over all
  compile threads (CPU seconds, not wall time).
- ``first_run``: the rest of the first step: executing it (forward, backward, optimizer, the
  first-run rank check and pool growth) and anything eager.

A phase is only as exact as torch's span boundaries; a key that is missing (an older or newer
torch, a path that does not time itself) shows up as time in ``aot`` or ``first_run``, never as
lost time. FX-graph and AOTAutograd cache hits come from ``torch._dynamo.utils.counters``.
The record also keeps every key's own time in the step (``CompilePhases.timers``, nested spans
each counted whole, so they do not add up): a phase is a difference of spans, and only the keys
say which span inside it took the time (the re-plan's ``aot`` at qwen3-14b ran 4.1-5.0 s at one
placement and 1.8-1.9 s at the other, benches/results/onepath14.md).

[Note: why a cache was bypassed]
A bypassed cache (``fxgraph_bypass``, ``aot_bypass``) rules out a warm start, and the counter
does not say why: torch logs the reason at INFO level only ("Bypassing FX Graph Cache because
...", "Bypassing autograd cache due to: ..."), below the default level. The clock lowers those
two loggers to INFO for the step, keeps the bypass lines, and passes on only what the logger's
own level would have passed, so nothing new is printed; the reasons go into the record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["PHASES", "PHASE_LABELS", "TIMER_FLOOR_S", "ZBUF_KEYS", "CompilePhases", "PhaseClock",
           "phases_from", "timers_from"]

PHASES = ("dynamo", "aot", "zbuf", "inductor", "kernel_compile", "first_run")
"""The phases, in the order a first step goes through them."""

PHASE_LABELS = {
    "dynamo": "Dynamo tracing",
    "aot": "AOT joint graph + partitioning",
    "zbuf": "zbuf passes",
    "inductor": "Inductor lowering + codegen",
    "kernel_compile": "Triton/C++ compile (waited)",
    "first_run": "first run",
}

ZBUF_KEYS = {
    "zbuf.tag_for_regather": "tag_for_regather",
    "zbuf.plan": "plan",
    "zbuf.rewrite": "rewrite",
    "zbuf.fingerprint": "fingerprint",
}
"""``dynamo_timed`` keys of zbuf's passes -> names in ``CompilePhases.zbuf_passes``. The outer
span of the post-grad pass is ``zbuf.schedule_pass`` (it includes the three below it)."""

_ZBUF_OUTER = ("zbuf.tag_for_regather", "zbuf.schedule_pass")
_KERNEL_WAIT = ("async_compile.wait", "async_compile.precompile",
                "CachingAutotuner.benchmark_all_configs",
                "CachingAutotuner.coordinate_descent_tuning")

TIMER_FLOOR_S = 0.01
"""Keys that spent less in a step are left out of ``CompilePhases.timers``."""

_CACHE_COUNTERS = {
    "fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
    "fxgraph_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "graphs": ("stats", "unique_graphs"),
}

_BYPASS_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
"""The modules whose INFO lines say why a cache was bypassed ([Note: why a cache was
bypassed])."""


class _BypassReasons(logging.Filter):
    """Keeps the bypass lines of one logger while it runs at INFO; lets through only records at
    or above the level the logger had before."""

    def __init__(self, logger: logging.Logger, reasons: list[str]) -> None:
        super().__init__()
        self.logger, self.reasons = logger, reasons
        self.level = logger.level
        self.passes = logger.getEffectiveLevel()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).startswith("Bypassing"):
            reason = record.getMessage().splitlines()[0][:300]
            if reason not in self.reasons:
                self.reasons.append(reason)
        return record.levelno >= self.passes

    @contextlib.contextmanager
    def active(self):
        self.logger.addFilter(self)
        self.logger.setLevel(min(self.passes, logging.INFO))
        try:
            yield
        finally:
            self.logger.setLevel(self.level)
            self.logger.removeFilter(self)


@dataclass
class CompilePhases:
    """One rank's first step, cut into phases (seconds); see [Note: compile phases]."""

    first_step_s: float
    """Wall time of the step, as the step timer measured it."""
    phases: dict[str, float]
    """Phase name (``PHASES``) -> seconds; the values add up to ``first_step_s``."""
    zbuf_passes: dict[str, float] = field(default_factory=dict)
    """zbuf's passes one by one (``ZBUF_KEYS`` names), seconds summed over graphs."""
    kernel_compile_work_s: float = 0.0
    """C++/Triton compile time summed over every compile thread (CPU seconds)."""
    caches: dict[str, int] = field(default_factory=dict)
    """Inductor FX-graph and AOTAutograd cache hits/misses/bypasses, and the Dynamo graphs
    compiled, during the step."""
    cpu_s: float = 0.0
    """CPU seconds the step used: every thread of the process plus the finished child processes
    (compilers). On a shared machine a steadier measure of the work than wall time."""
    cache_bypass_reasons: list[str] = field(default_factory=list)
    """Why torch bypassed a cache during the step, one line per distinct reason ([Note: why a
    cache was bypassed])."""
    timers: dict[str, float] = field(default_factory=dict)
    """Each of torch's (and zbuf's) ``dynamo_timed`` keys -> its seconds in the step, at least
    ``TIMER_FLOOR_S``, longest first; nested spans each counted whole."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _new(after: Mapping[str, list[float]], before: Mapping[str, int], key: str) -> float:
    return float(sum(after.get(key, [])[before.get(key, 0):]))


def timers_from(before: Mapping[str, int], after: Mapping[str, list[float]]) -> dict[str, float]:
    """Each key's seconds between two readings of the timers, at least ``TIMER_FLOOR_S``,
    longest first."""
    spent = {key: _new(after, before, key) for key in after}
    return dict(sorted(((k, v) for k, v in spent.items() if v >= TIMER_FLOOR_S),
                       key=lambda kv: -kv[1]))


def phases_from(before: Mapping[str, int], after: Mapping[str, list[float]], first_step_s: float,
                compile_threads: int = 2) -> tuple[dict[str, float], dict[str, float], float]:
    """Phases, zbuf's passes and the kernel-compile work from two readings of the timers.

    ``before``: each key's number of spans before the step; ``after``: the spans after it
    (``compilation_time_metrics``). ``compile_threads``: Inductor's compile threads (with one,
    kernels compile on the main thread inside ``compile_file`` spans, otherwise in a pool).
    """
    s = lambda k: _new(after, before, k)  # noqa: E731
    backend = s("OutputGraph.call_user_compiler")
    compiling = s("_compile.compile_inner") + s("backward._backward_impl")
    inner = s("compile_fx_inner")
    kernel = sum(s(k) for k in _KERNEL_WAIT)
    work = s("compile_file")
    if compile_threads <= 1:
        kernel += work
    zbuf_total = sum(s(k) for k in _ZBUF_OUTER)
    zbuf_in_inductor = s("zbuf.schedule_pass") if inner > 0 else 0.0
    dynamo = max(0.0, s("_compile.compile_inner") - backend)
    inductor = max(0.0, inner - kernel - zbuf_in_inductor) if inner > 0 else 0.0
    # Autotuning at the first launch runs after compiling, inside the step's execution.
    kernel_in_compile = kernel - s("CachingAutotuner.benchmark_all_configs") \
        - s("CachingAutotuner.coordinate_descent_tuning")
    aot = max(0.0, compiling - dynamo - zbuf_total - inductor - kernel_in_compile)
    first_run = max(0.0, first_step_s - compiling - (kernel - kernel_in_compile))
    phases = {"dynamo": dynamo, "aot": aot, "zbuf": zbuf_total, "inductor": inductor,
              "kernel_compile": kernel, "first_run": first_run}
    passes = {name: s(key) for key, name in ZBUF_KEYS.items() if s(key) > 0}
    return phases, passes, work


class PhaseClock:
    """Reads torch's compile timers and cache counters around one step.

    ``with PhaseClock() as clock: step()``, then ``clock.result(step_seconds)``. Nothing is
    patched or reset: the clock remembers how many spans each key had and counts the new ones.
    """

    def __enter__(self) -> "PhaseClock":
        from torch._dynamo.utils import compilation_time_metrics, counters

        self._metrics = compilation_time_metrics
        self._counters = counters
        self._before = {k: len(v) for k, v in compilation_time_metrics.items()}
        self._counts0 = self._read_counters()
        self._cpu0 = self._cpu()
        self._reasons: list[str] = []
        self._logging = contextlib.ExitStack()
        for name in _BYPASS_LOGGERS:
            self._logging.enter_context(
                _BypassReasons(logging.getLogger(name), self._reasons).active())
        return self

    def __exit__(self, *exc) -> None:
        self._after = {k: list(v) for k, v in self._metrics.items()}
        self._counts1 = self._read_counters()
        self._cpu1 = self._cpu()
        self._logging.close()

    @staticmethod
    def _cpu() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def _read_counters(self) -> dict[str, int]:
        return {name: int(self._counters[group][key])
                for name, (group, key) in _CACHE_COUNTERS.items()}

    def result(self, first_step_s: float) -> CompilePhases:
        from torch._inductor.async_compile import get_compile_threads

        phases, passes, work = phases_from(self._before, self._after, first_step_s,
                                           get_compile_threads())
        caches = {k: self._counts1[k] - self._counts0[k] for k in self._counts1}
        return CompilePhases(first_step_s, phases, passes, work, caches, self._cpu1 - self._cpu0,
                             list(self._reasons), timers_from(self._before, self._after))
