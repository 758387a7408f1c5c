"""What an optimizer costs in memory, known before its first step (a policy object, as FSDP2's
``MixedPrecisionPolicy`` and ``OffloadPolicy`` are): the one place that knows it.

[Note: optimizer state bytes]
An optimizer's state is created lazily by its first ``step()``, after any memory measured before
it, so a plan made before step 0 must reserve it from what is known then: the shards it will
update and the optimizer's type. Per element of a trainable shard (fp32 state, whatever the
parameter's dtype: ``torch.optim`` keeps state in the parameter's dtype, and zbuf's shards are
the fp32 masters):
* AdamW / Adam: two copies (``exp_avg``, ``exp_avg_sq``), plus a scalar ``step`` per parameter;
* SGD with momentum: one (``momentum_buffer``); without momentum: none;
* other optimizers: two copies (the most of torch's own; an unknown optimizer is budgeted as an
  Adam, never as free).
Temporaries of the step, by implementation (``foreach`` / ``fused`` / a per-parameter loop):
* foreach (torch's default on CUDA): intermediates the size of all the parameters it updates at
  once (pytorch#97712: FSDP2 users run out of memory at the first ``step()`` from exactly this);
  one such intermediate is reserved;
* fused: no parameter-sized temporaries;
* a per-parameter loop (``foreach=False``, and torch's default on CPU): one intermediate the size
  of the largest parameter.
The gradients are not the optimizer's: the step's memory owner reserves them separately.
The state is reserved beside the graphs: it lives from the first ``step()`` on, through every
later forward and backward. The temporaries are not: they live inside ``step()`` only, when the
graphs' activations are freed and the pool has lent its idle blocks ([Note: whole-step budget]
in step.py), so they share that memory rather than add to it: reserving them beside the
graphs too would refuse plans FSDP2 runs. What the step needs is that the temporaries fit in the
memory the graphs share; ``zbuf.compile`` refuses one whose temporaries cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

import torch

__all__ = ["OptimizerPolicy", "STATE_COPIES"]

Implementation = Literal["foreach", "fused", "for-loop"]

STATE_COPIES = {"AdamW": 2, "Adam": 2, "SGD": 1}
"""Shard-sized state tensors per optimizer class ([Note: optimizer state bytes]); SGD without
momentum keeps none."""


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@dataclasses.dataclass(frozen=True)
class OptimizerPolicy:
    """The memory an optimizer's state and step need ([Note: optimizer state bytes])."""

    name: str
    """The optimizer's class name."""
    state_copies: int
    """Shard-sized state tensors kept per parameter."""
    implementation: Implementation
    """How its step runs, which decides its temporaries."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "OptimizerPolicy":
        name = type(optimizer).__name__
        defaults = optimizer.defaults
        copies = STATE_COPIES.get(name, 2)
        if name == "SGD" and not defaults.get("momentum", 0):
            copies = 0
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if defaults.get("fused"):
            impl: Implementation = "fused"
        elif defaults.get("foreach") is False:
            impl = "for-loop"
        elif defaults.get("foreach") or (params and params[0].is_cuda):
            impl = "foreach"  # torch's default on CUDA (foreach=None)
        else:
            impl = "for-loop"
        return cls(name, copies, impl)

    @staticmethod
    def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return _unique(p for g in optimizer.param_groups for p in g["params"])

    def state_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """Bytes of the state the first step creates for ``params`` (scalar steps ignored)."""
        return self.state_copies * sum(p.numel() * p.element_size() for p in _unique(params))

    def temporary_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """Bytes of the step's largest temporaries for ``params``."""
        sizes = [p.numel() * p.element_size() for p in _unique(params)]
        if self.implementation == "fused" or not sizes:
            return 0
        return sum(sizes) if self.implementation == "foreach" else max(sizes)

    def batch_temporary_bytes(self, optimizer: torch.optim.Optimizer, batch_bytes: int) -> int:
        """Bytes of the step's largest temporaries when it runs over batches of parameters of
        ``batch_bytes`` or more, a batch closed by the parameter that reaches it ([Note:
        optimizer in backward] in zbuf/optimizer_in_backward.py)."""
        sizes = [p.numel() * p.element_size() for p in self._params(optimizer)]
        if self.implementation == "fused" or not sizes:
            return 0
        return max(sizes) + (batch_bytes if self.implementation == "foreach" else 0)

    def offloaded_state_bytes(self, optimizer: torch.optim.Optimizer, batch_bytes: int) -> int:
        """Bytes of state on the device when it lives in host memory between the steps in
        backward ([Note: optimizer state off the device] in zbuf/optimizer_offload.py): two
        batches' (the one stepping and the next, prefetched), whatever their order. A batch is
        closed by the parameter that reaches ``batch_bytes``, so it holds less than
        ``batch_bytes`` plus that parameter; two batches, less than twice ``batch_bytes`` plus
        the two largest parameters. Never more than all of it."""
        ps = self._params(optimizer)
        sizes = sorted((p.numel() * p.element_size() for p in ps), reverse=True)
        two_batches = 2 * batch_bytes + sum(sizes[:2])
        return min(self.state_bytes(ps), self.state_copies * two_batches)

    def step_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """``(state, temporaries)`` of ``optimizer``'s step over all of its parameters: what a
        plan made before step 0 reserves beside the graphs, and what the step needs on top of
        that while the graphs hold nothing ([Note: optimizer state bytes])."""
        ps = self._params(optimizer)
        return self.state_bytes(ps), self.temporary_bytes(ps)
