"""Program points inside a step's forward and backward, the same in every step and on every rank.

[Note: progress points]
The meter's phases ([Note: phase peaks] in phases.py) say what a step holds between its
forward, backward and optimizer step; what the step's window ([Note: the step's window] in
zbuf/offload_window.py) needs is finer: how much memory is free late in backward and early in
forward. Two kinds of points mark a step's progress there, each counted from its phase's start:

* forward: point 0 is the forward's start (the model's forward pre-hook), point ``k`` the start
  of the ``k``-th block frame called outside backward (``BlockFrames``' observers; the whole
  graph has none, and its forward only point 0);
* backward: point 0 is the backward's start (the model's output: the meter's own boundary),
  point ``j`` the gradient that brings the bytes arrived in this backward past ``j *
  MARK_BYTES`` (post-accumulate-grad hooks on the model's trainable parameters, installed
  when a step is first profiled, so that a run without the window pays no hook per gradient: a
  block frame's backward delivers its block's gradients as it ends, the whole graph all of them
  at its end).

Both depend only on the sequence of calls and the parameters' sizes, never on timing, so a
point names the same place in the program in every step of a run and on every rank.

The progress also remembers the last backward point at which another user of the upward host
link, the offloaded blocks' uploads, began a copy (``link_busy_until``): the state's window
uploads after it ([Note: the step's window]).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import nn

__all__ = ["Point", "StepProgress", "MARK_BYTES"]

MARK_BYTES = 256 << 20
"""Gradient bytes between two backward points: a few per block of a large model (qwen3-14b as
rank 0 of 8: 0.19 GB of fp32 gradients a block, 29 points in all), few enough that reading the
allocator's peaks at each costs nothing measurable."""


class Point(NamedTuple):
    """A progress point ([Note: progress points])."""

    phase: str
    """"forward" or "backward"."""
    index: int


class StepProgress:
    """Calls each of ``listeners`` with every progress point of ``model``'s steps ([Note:
    progress points]). ``forward_started`` and ``backward_started`` are called by the step's
    memory owner at its phase boundaries; ``forward_block`` by the block frames. Backward's
    gradient marks need a hook on every trainable parameter, installed by ``watch_gradients``
    when something first needs them (until then a backward has only its point 0)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.listeners: list[Callable[[Point], None]] = []
        self._forward_blocks = 0
        self._arrived = 0
        self._marks = 0
        self._handles: list = []
        self._in_backward = False
        self.link_busy_until = -1
        """The last backward point of the latest backward at which an offloaded block's upload
        began (``upload_started``); -1: none."""

    def watch_gradients(self) -> None:
        """Mark backward's progress from now on (idempotent)."""
        if self._handles:
            return
        for p in self.model.parameters():  # each once, tied ones too
            if p.requires_grad:
                nbytes = p.numel() * p.element_size()  # the gradient has the shard's dtype
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _p, n=nbytes: self._gradient(n)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def forward_started(self) -> None:
        self._forward_blocks = 0
        self._in_backward = False
        self._emit(Point("forward", 0))

    def forward_block(self) -> None:
        self._forward_blocks += 1
        self._emit(Point("forward", self._forward_blocks))

    def backward_started(self) -> None:
        self._arrived = self._marks = 0
        self._in_backward = True
        self.link_busy_until = -1
        self._emit(Point("backward", 0))

    def upload_started(self) -> None:
        """An offloaded block's upload began (in backward: at the current point)."""
        if self._in_backward:
            self.link_busy_until = self._marks

    def _gradient(self, nbytes: int) -> None:
        self._arrived += nbytes
        while self._arrived >= (self._marks + 1) * MARK_BYTES:
            self._marks += 1
            self._emit(Point("backward", self._marks))

    def _emit(self, point: Point) -> None:
        for listener in self.listeners:
            listener(point)

