"""The optimizer step in backward: each shard is updated as soon as its gradient is reduced, and
the gradient is freed at once.

[Note: optimizer in backward]
A ZeRO-3 step holds, beside the shards and the optimizer's state, every gradient shard from its
reduce-scatter to the optimizer step after backward: at world 1 with fp32 shards and AdamW,
a quarter of the step's state (6.4 GiB of 25.6 at qwen3-1.7b), and the part that peaks at the
end of backward, where the activations are gone. Updating each shard in backward, right after
its gradient is reduce-scattered, and dropping the gradient then (what torch's
``_apply_optimizer_in_backward`` and torchtune's optimizer-in-backward do with per-parameter
hooks) keeps a few gradient shards alive at any moment instead of all of them.

How: with ``zbuf.compile(model, optimizer=opt, optimizer_in_backward=True)`` the schedule pass
ends each gradient shard of the backward graph in ``zbuf::step_in_backward`` (batches of about
``BATCH_BYTES``, in the order the reduce-scatters finish; compile/rewrite.py) on the schedule
token, and the graph returns no gradient for those shards. The op's kernel hands the batch to
this model's ``BackwardStep`` (found through the parameter ids, [Note: counts live with their
model] in runtime.py), which sets the shards' ``.grad``, runs the user's own optimizer over just
those shards (its ``param_groups`` narrowed to them for the call: the same hyperparameters, the
same per-parameter state, so ``state_dict()``, checkpoints and LR schedulers see one optimizer),
and sets ``.grad`` back to None. Per parameter the update is the one ``opt.step()`` makes after
backward (torch's optimizers update each parameter from its own gradient and state), so the
result is the same; the user's ``opt.step()`` after backward finds no gradient on those shards
and leaves them alone, and steps any parameter whose gradient did not come from a zbuf
reduce-scatter as before.

What changes for the user, so it is opt-in:
* every backward is an optimizer step: gradients cannot be accumulated over micro-batches;
* there is no gradient left to clip or inspect after backward: ``zbuf.clip_grad_norm_``
  refuses (its norm would be 0 and nothing clipped); torch's own ``clip_grad_norm_`` would see
  no gradients;
* ``fullgraph=True``: each parameter's gradient is reduced once per backward only if one graph
  makes it (a graph break could split a parameter's uses, and it would be stepped twice).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import runtime
from .optimizer_offload import StateOffload
from .shard import roots

__all__ = ["BackwardStep", "BATCH_BYTES"]

BATCH_BYTES = 64 << 20
"""Gradient bytes one ``zbuf::step_in_backward`` updates at once: a foreach step's launches and
host cost are per call, its temporaries per byte (about one batch)."""


class BackwardStep:
    """Steps ``optimizer`` in backward on the shards of ``model`` ([Note: optimizer in
    backward]); lives as long as the model's compiled wrapper holds it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 offload: bool = False) -> None:
        found = roots(model)
        if not found:
            raise ValueError("optimizer_in_backward=True steps the shards of a model sharded "
                             "with zbuf.shard; shard the model first")
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.optimizer = optimizer
        self.params: dict[int, nn.Parameter] = {}
        self._groups: dict[int, dict] = {}
        for root in found:
            for param_id, shard in root.shards.items():
                if shard.requires_grad and id(shard) in group_of:
                    self.params[param_id] = shard
                    self._groups[param_id] = group_of[id(shard)]
            root.steps_in_backward = True
        self.offload: Optional[StateOffload] = (
            StateOffload(optimizer, found[0].device) if offload else None)
        """The optimizer's state kept in host memory between batches ([Note: optimizer state
        off the device] in optimizer_offload.py), or None."""
        runtime.step_into(self.params, self)

    def step(self, grads: list[torch.Tensor], param_ids: list[int]) -> None:
        """Update the shards ``param_ids`` with their gradients ``grads`` and drop the gradients."""
        by_group: dict[int, tuple[dict, list[nn.Parameter]]] = {}
        for param_id, grad in zip(param_ids, grads):
            p = self.params[param_id]
            p.grad = grad
            group = self._groups[param_id]
            by_group.setdefault(id(group), (group, []))[1].append(p)
        opt = self.optimizer
        stepped = [p for _group, ps in by_group.values() for p in ps]
        key = tuple(param_ids)
        if self.offload is not None:
            self.offload.bring(key, stepped)
        everything = opt.param_groups
        opt.param_groups = [dict(group, params=ps) for group, ps in by_group.values()]
        try:
            opt.step()
        finally:
            opt.param_groups = everything
            for p in stepped:
                p.grad = None
        if self.offload is not None:
            self.offload.put_back(key, stepped)
