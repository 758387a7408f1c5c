"""Eager mode: one reduce-scatter per parameter per forward, however many times it was gathered.

[Note: reduce once]
A parameter gathered at several use sites of one forward (tied embeddings: the embedding lookup
and the output head) gets one gradient contribution per use in backward. Reduce-scattering each
one separately is exact but costs one collective per use (for a tied vocabulary matrix, the
largest collective of the step, twice). Instead the eager path sums the full-size contributions
locally and reduce-scatters the sum once, which is also what the unsharded reference does
(autograd sums the full gradient).

Bookkeeping, per sharded root (its ``ReduceOnce``, ``ShardedRoot.reduce_once``) under one lock,
keyed by forward *generation* and ``param_id``:
* A generation starts with every outermost forward of a sharded root module (``new_forward``,
  from the root's forward pre-hook), not inside a backward.
* ``count_use`` counts every gather that autograd records (grad mode on, the shard requires grad)
  in the current generation, unless it runs inside a backward: that is an activation-checkpointing
  recompute (non-reentrant: its autograd node never runs backward; reentrant: its backward runs
  in a nested graph task), not counted, and its backward reduce-scatters on its own. Gathers
  under ``no_grad`` record no node and are not counted either.
* ``contribute`` (backward of one use): while uses of its generation remain, the gradient is added
  into a padded, flat accumulator in the reduce dtype (the first one is copied in) and the node
  returns no gradient for the shard. The contribution that brings the count to zero
  reduce-scatters the accumulator (for a parameter used once: its own gradient, no copy, so the
  common case costs nothing extra) and its node returns the shard gradient, which autograd's
  AccumulateGrad adds to ``shard.grad`` as before.
* End of the backward (``queue_callback`` on the graph task, queued by its first counted
  contribution): accumulators still open (a use whose output does not reach the loss never
  contributes) are reduce-scattered in (generation, ``param_id``) order and added to
  ``shard.grad`` directly; then the counts of every generation that contributed are dropped (its
  backward has happened). A forward that is never backpropagated (an evaluation forward with grad
  on) leaves its counts behind, which touch no other generation's reduction; they are dropped
  once ``MAX_OPEN_GENERATIONS`` newer forwards have started.

Why generations: counts are per forward, so micro-batches work in any order (forward, backward,
forward, backward; or several forwards, then one backward of the summed losses, or their
backwards one by one: each forward's uses complete on their own), and a forward whose output is
dropped cannot hold back another forward's reduction. A dropped count only ever turns a merged
reduction back into per-use ones; it never changes a gradient. Every decision depends only on the
sequence of forwards and backwards, never on timing or on when Python frees objects, so all
ranks of an SPMD program issue the same reduce-scatters in the same order (what every collective
needs: [Note: collective order check] in compile/fingerprint.py).

The trade: the accumulator (one padded parameter in the reduce dtype) lives from the first
contribution to the last, for a tied embedding from the head's backward near the start of the
backward to the embedding's near its end. That is the bytes the reduce-scatter's own padded
input needs anyway, held longer, in exchange for one collective of the same size fewer. With
several forwards backpropagated together, each holds its own accumulator. Parameters used once
per forward never allocate one.

Limits: an end-of-backward flush writes ``shard.grad`` directly, so it reaches ``.backward()``
but not ``torch.autograd.grad`` and runs no post-accumulate-grad hooks; it happens only for uses
that never contribute. The compiled path merges the reduce-scatters of one graph instead
(``zbuf.compile.tied``).
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

import torch

from .ops import reduce_scatter_impl
from .param import ShardSpec
from .runtime import in_backward

__all__ = ["MAX_OPEN_GENERATIONS", "ReduceOnce"]

MAX_OPEN_GENERATIONS = 16
"""How many of the latest forwards keep their counts while their backward is pending; an older
forward's uses, if it is backpropagated after all, are reduce-scattered one by one."""


def _reduce(grad: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    return reduce_scatter_impl(grad, spec.param_id, spec.shard_numel, spec.group_name,
                               spec.reduce_dtype, spec.dtype)


def _accumulate(acc: Optional[torch.Tensor], grad: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    if acc is None:
        rdtype = spec.reduce_dtype if spec.reduce_dtype is not None else grad.dtype
        # Padded like the reduce-scatter's input, so the final reduce needs no copy.
        acc = grad.new_zeros(spec.padded_numel, dtype=rdtype)
        acc[: spec.numel].view(grad.shape).copy_(grad)
    else:
        acc[: spec.numel].view(grad.shape).add_(grad)
    return acc


class ReduceOnce:
    """[Note: reduce once] for the parameters of one sharded root."""

    def __init__(self, counters: collections.Counter) -> None:
        self.counters = counters
        """Where ``grad_accumulate`` and ``reduce_scatter_flush`` are counted (the root's)."""
        self._lock = threading.Lock()
        self._gen = 0
        """Current forward generation (producer: ``new_forward``; consumer: ``count_use``)."""
        self._uses: dict[int, dict[int, int]] = {}
        """generation -> param_id -> counted uses whose contribution has not arrived. Producer:
        ``count_use``; consumers: ``contribute`` (decrements), ``_finish`` and ``new_forward``
        (drop)."""
        self._acc: dict[tuple[int, int, int], tuple[torch.Tensor, torch.nn.Parameter, ShardSpec]] = {}
        """(graph task, generation, param_id) -> (accumulator, shard, spec): contributions summed
        so far in that backward. Producer and consumer: ``contribute``; leftovers: ``_finish`` of
        that task."""
        self._tasks: dict[int, set[int]] = {}
        """graph task -> generations that contributed to it; its end-of-backward callback is
        queued. Producer: ``contribute``; consumer: ``_finish``."""

    def open_uses(self) -> int:
        """Counted uses still waiting for their backward (tests check how this drains)."""
        with self._lock:
            return sum(n for uses in self._uses.values() for n in uses.values())

    def open_accumulators(self) -> int:
        """Accumulators currently held (tests check that none outlives a backward)."""
        with self._lock:
            return len(self._acc)

    def new_forward(self) -> None:
        """The root's outermost forward starts: later gathers count in a new generation."""
        if in_backward():  # a checkpoint recompute of the root forward
            return
        with self._lock:
            self._gen += 1
            uses = self._uses
            # keys are generations in increasing order: the oldest come first
            while uses and next(iter(uses)) <= self._gen - MAX_OPEN_GENERATIONS:
                del uses[next(iter(uses))]

    def count_use(self, spec: ShardSpec) -> Optional[int]:
        """Count a gather whose backward will contribute; returns its generation, or None if it
        is a checkpoint recompute. Call only when autograd records the gather (grad on, the shard
        requires grad)."""
        if in_backward():
            return None
        with self._lock:
            if self._tasks:
                # A backward raised before its end-of-backward callback ran; none runs now (this
                # is a forward), so nothing would ever complete what it left.
                self._acc.clear()
                self._tasks.clear()
            uses = self._uses.setdefault(self._gen, {})
            uses[spec.param_id] = uses.get(spec.param_id, 0) + 1
            return self._gen

    def contribute(
        self, grad: torch.Tensor, shard: torch.nn.Parameter, spec: ShardSpec, gen: Optional[int]
    ) -> Optional[torch.Tensor]:
        """One use's gradient arrives in backward; returns the shard gradient, or None while held."""
        if gen is None:
            return _reduce(grad, spec)
        task = torch._C._current_graph_task_id()
        key = (task, gen, spec.param_id)
        with self._lock:
            uses = self._uses.get(gen)
            left = 0
            if uses is not None and spec.param_id in uses:
                left = uses[spec.param_id] - 1
                if left:
                    uses[spec.param_id] = left
                else:
                    del uses[spec.param_id]
            held = self._acc.pop(key, None)
            first_in_task = task not in self._tasks
            self._tasks.setdefault(task, set()).add(gen)
        if first_in_task:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(task))
        if left == 0:
            if held is None:
                return _reduce(grad, spec)
            return _reduce(_accumulate(held[0], grad, spec), spec)
        acc = _accumulate(held[0] if held is not None else None, grad, spec)
        self.counters["grad_accumulate"] += 1
        with self._lock:
            self._acc[key] = (acc, shard, spec)
        return None

    def _finish(self, task: int) -> None:
        """End of one backward: flush what it left open, drop the counts of its generations."""
        with self._lock:
            keys = sorted(k for k in self._acc if k[0] == task)
            leftovers = [self._acc.pop(k) for k in keys]
            for gen in self._tasks.pop(task, ()):
                self._uses.pop(gen, None)
        for acc, shard, spec in leftovers:
            grad = _reduce(acc, spec)
            self.counters["reduce_scatter_flush"] += 1
            with torch.no_grad():
                if shard.grad is None:
                    shard.grad = grad
                else:
                    shard.grad.add_(grad)
