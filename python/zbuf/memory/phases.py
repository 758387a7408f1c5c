"""Measure a training step's memory by phase: forward, backward, optimizer.

[Note: phase peaks]
A step's phases are delimited on the host, where allocations are made in program order: the
forward runs from the module's forward pre-hook to its forward hook, backward from there to the
optimizer's step pre-hook, the optimizer from there to its step post-hook (without an optimizer
attached, "backward" runs to the end of the step and includes whatever the optimizer did). At
every boundary the meter reads the peak of the phase that ends and resets it:

* CUDA: ``torch.cuda.max_memory_allocated`` (live tensors) and ``max_memory_reserved`` (what the
  caching allocator holds: live tensors plus its cache and fragmentation, the memory that
  competes with the pool), then ``reset_peak_memory_stats``. The pool's blocks are not in either.
  The meter owns the device's peak counters: anything else that wants a peak over several
  phases (the run record's peak device memory) takes the maximum of the meter's rows.
* CPU (a deterministic stand-in, so that the mechanism is testable without a GPU): host memory
  has no allocator statistics, so the meter counts the bytes of the tensors it can see, the
  module's parameters and gradients and the optimizer's state, at each boundary; a phase's peak
  is the larger of its two ends. Temporaries and activations are invisible to it.

A step opens at the first forward after the previous one closed, and closes at the next such
forward or at ``close_step``. With an optimizer attached, forwards before the optimizer ran
(gradient accumulation) belong to the same step.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from ..runtime import in_backward
from .progress import Point

__all__ = ["StepPhases", "StepProfile", "PhaseMeter", "PHASES"]

PHASES = ("forward", "backward", "optimizer")

ROWS_KEPT = 4096
"""Closed steps whose rows a meter keeps (a long run keeps the latest)."""


class StepPhases(NamedTuple):
    """One step's memory on one rank, as the meter measured it (bytes, torch's allocator only:
    the pool's blocks are not included)."""

    step: int
    """Steps closed before this one by the same meter."""
    start_bytes: int
    """Allocated at the step's start (parameters, optimizer state, whatever the program keeps)."""
    forward_peak_bytes: int
    """Peak allocated during the forward."""
    backward_peak_bytes: int
    """Peak allocated during backward (without an optimizer attached: to the end of the step)."""
    optimizer_peak_bytes: Optional[int]
    """Peak allocated during the optimizer step; None when no optimizer was measured."""
    forward_reserved_bytes: int
    """Peak reserved by the caching allocator during the forward (CPU: as allocated)."""
    backward_reserved_bytes: int
    """Peak reserved during backward (CPU: as allocated)."""
    optimizer_reserved_bytes: Optional[int]
    """Peak reserved during the optimizer step (CPU: as allocated); None as above."""
    retries: tuple[int, int, int] = (0, 0, 0)
    """The caching allocator's retries (``num_alloc_retries``: a request it could serve only
    after freeing its cache) in the forward, backward and optimizer phases (CPU: none), so that
    a step that retried says where."""

    @property
    def reserved_peak_bytes(self) -> int:
        """The step's peak reserved bytes over all phases."""
        return max(self.forward_reserved_bytes, self.backward_reserved_bytes,
                   self.optimizer_reserved_bytes or 0)

    @property
    def allocated_peak_bytes(self) -> int:
        """The step's peak allocated bytes over all phases."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes,
                   self.optimizer_peak_bytes or 0)


def _tensor_bytes(t: Any) -> int:
    """Bytes this rank holds for ``t`` (a DTensor, as FSDP2's parameters: its local shard)."""
    if not isinstance(t, torch.Tensor):
        return 0
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    return t.numel() * t.element_size()


class StepProfile(NamedTuple):
    """One step's allocated peaks between its progress points ([Note: progress points] in
    progress.py), in bytes, as the meter read them (CPU: the tracked bytes)."""

    step: int
    forward: tuple[int, ...]
    """``forward[k]``: the peak from forward point ``k`` to point ``k + 1`` (the last: to the
    forward's end)."""
    backward: tuple[int, ...]
    """``backward[j]``: the peak from backward point ``j`` to point ``j + 1`` (the last: to the
    optimizer step)."""
    optimizer: int
    """The optimizer step's peak (0: no optimizer measured)."""

    @property
    def peak(self) -> int:
        return max((*self.forward, *self.backward, self.optimizer))


class PhaseMeter:
    """Per-phase memory peaks of the steps of ``module`` (+ ``optimizer``) on ``device`` ([Note:
    phase peaks]).

    Driven either by hooks (``attach``: what ``zbuf.compile(..., optimizer=...)`` does) or by
    explicit ``mark`` calls from a training loop whose modules cannot carry hooks; not both.
    """

    def __init__(self, device: torch.device, module: nn.Module,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.device = torch.device(device)
        self.module = module
        self.optimizer = optimizer
        self.rows: collections.deque[StepPhases] = collections.deque(maxlen=ROWS_KEPT)
        """The latest closed steps' rows, oldest first."""
        self.closed = 0
        """Steps closed so far."""
        self.on_close: Optional[Callable[[StepPhases], None]] = None
        """Called with each row as its step closes (however it closes)."""
        self._phase: Optional[str] = None  # None: no step open; else the running phase
        self._start = 0
        self._peaks: dict[str, tuple[int, int]] = {}
        self._boundary = 0  # CPU: tracked bytes at the running phase's start
        self._retries: dict[str, int] = {}
        """Each phase's allocator retries so far in the open step (CUDA)."""
        self._retries_read = 0  # CUDA: the allocator's retry counter at the running phase's start
        self._handles: list[Any] = []
        self._optimizer_ran = False
        self._segments: Optional[dict[str, list[int]]] = None
        """While the open step is profiled: each phase's segment peaks so far."""
        self.profile: Optional[StepProfile] = None
        """The last profiled step's peaks between its progress points."""
        self.off_device_bytes: Optional[Callable[[], int]] = None
        """CPU stand-in: bytes of the optimizer's state held in its host copies, not counted
        ([Note: optimizer state offloaded after backward] in zbuf/optimizer_step_offload.py;
        on CUDA host memory is not in the allocator's counts anyway)."""

    @property
    def phase(self) -> Optional[str]:
        """The running phase ("forward", "backward", "optimizer"); None outside a step."""
        return self._phase

    # -- driving ------------------------------------------------------------------------------

    def attach(self, module: Optional[nn.Module] = None) -> "PhaseMeter":
        """Mark phases with hooks on ``module`` (default: the measured module; pass the compiled
        wrapper when the measured module runs inside a compiled graph) and on the optimizer."""
        target = module if module is not None else self.module
        self._handles.append(target.register_forward_pre_hook(
            lambda _m, _args: self.mark("forward")))
        self._handles.append(target.register_forward_hook(
            lambda _m, _args, _out: self.mark("backward")))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(
                lambda _o, _a, _k: None if in_backward() else self.mark("optimizer")))
            self._handles.append(self.optimizer.register_step_post_hook(
                lambda _o, _a, _k: None if in_backward() else self.mark("after")))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def mark(self, phase: str) -> None:
        """Start ``phase`` ("forward", "backward", "optimizer" or "after": the optimizer ended)."""
        if phase == "forward":
            if self._phase is not None and (self.optimizer is None or self._optimizer_ran):
                self.close_step()
            if self._phase is None:
                self._open()
            else:
                self._end_phase()
            self._phase = "forward"
            return
        if self._phase is None:
            return  # a boundary outside any measured step (e.g. an optimizer step before the first forward)
        self._end_phase()
        if phase == "after":
            self._optimizer_ran = True
            self._phase = "optimizer"  # zero_grad & co. until the step closes count as optimizer
        else:
            self._phase = phase

    def close_step(self) -> Optional[StepPhases]:
        """Close the open step (if any) and return its row."""
        if self._phase is None:
            return None
        self._end_phase()
        row = self.row_so_far()
        self.rows.append(row)
        if self._segments is not None:
            seg, self._segments = self._segments, None
            if seg["forward"] and seg["backward"]:
                self.profile = StepProfile(row.step, tuple(seg["forward"]),
                                           tuple(seg["backward"]), row.optimizer_peak_bytes or 0)
        self.closed += 1
        self._phase = None
        if self.on_close is not None:
            self.on_close(row)
        return row

    # -- measuring ----------------------------------------------------------------------------

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def resident_bytes(self) -> int:
        """Allocated now (CUDA), or the tracked tensors' bytes (CPU stand-in)."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return self.tracked_bytes()

    def tracked_bytes(self) -> int:
        """Bytes of the module's parameters and gradients and of the optimizer's state tensors."""
        total, seen = 0, set()
        for p in self.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += _tensor_bytes(p) + _tensor_bytes(p.grad)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                total += sum(_tensor_bytes(v) for v in state.values())
        if self.off_device_bytes is not None:
            total -= self.off_device_bytes()
        return total

    def row_so_far(self) -> StepPhases:
        """The open step's row from its ended phases (a phase not ended yet: as the one before
        it; the optimizer's: None)."""
        p = self._peaks
        fw = p.get("forward", (self._start, self._start))
        bw = p.get("backward", fw)
        opt = p.get("optimizer") if self.optimizer is not None else None
        return StepPhases(self.closed, self._start, fw[0], bw[0], opt[0] if opt else None,
                          fw[1], bw[1], opt[1] if opt else None,
                          tuple(self._retries.get(phase, 0) for phase in PHASES))

    def reserved_peak_so_far(self) -> int:
        """The largest reserved peak of the open step's ended phases (its start if none)."""
        return max((reserved for _alloc, reserved in self._peaks.values()), default=self._start)

    def _open(self) -> None:
        self._peaks = {}
        self._retries = {}
        self._optimizer_ran = False
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._retries_read = self._alloc_retries()
        else:
            self._start = self._boundary = self.tracked_bytes()

    def _alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def _end_phase(self) -> None:
        if self.cuda:
            now = self._alloc_retries()
            self._retries[self._phase] = (self._retries.get(self._phase, 0)
                                          + max(0, now - self._retries_read))
            self._retries_read = now
        alloc = self._fold()
        if self._segments is not None and self._phase in self._segments:
            self._segments[self._phase].append(alloc)

    def _fold(self) -> int:
        """Read and reset the peaks since the last read, fold them into the running phase's;
        returns the allocated peak read."""
        if self.cuda:
            alloc = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            now = self.tracked_bytes()
            alloc = reserved = max(self._boundary, now)
            self._boundary = now
        old = self._peaks.get(self._phase, (0, 0))
        self._peaks[self._phase] = (max(old[0], alloc), max(old[1], reserved))
        return alloc

    # -- the step's profile -------------------------------------------------------------------

    def profile_open_step(self) -> None:
        """Read the open step's allocated peak between each two progress points ([Note:
        progress points] in progress.py) of its forward and backward (from now: call it at its
        forward's start); ``profile`` holds them once it closes."""
        self._segments = {"forward": [], "backward": []}

    def segment(self, point: Point) -> None:
        """A progress point: while profiling, the segment before it ends (the phase's first
        point is its start: nothing before it)."""
        if self._segments is None or point.phase != self._phase or point.index == 0:
            return
        self._segments[self._phase].append(self._fold())
