"""Modules built on the meta device get real storage one submodule at a time while they shard.

[Note: materialising meta modules]
A module built on the meta device is materialised one submodule at a time, in ``modules()`` order:
the submodule's own meta parameters and buffers get real (uninitialised) storage on the target
device, ``init_fn(submodule)`` (default: ``submodule.reset_parameters()``) initialises them, and each
parameter is then cut to this rank's shard before the next submodule is touched. Peak memory is
one submodule's own full parameters plus the shards made so far. A submodule whose meta tensors
it cannot initialise (no ``reset_parameters`` and no ``init_fn``) is an error rather than silent
garbage. Because every rank runs the same initialisation from the same RNG state, the shards
agree across ranks; initialising in ``modules()`` order equals eager construction for models that
register submodules in the order they build them (``zbuf.models`` does).
"""

from __future__ import annotations

import torch
from torch import nn

from .shard_state import ShardingError

__all__ = ["materialise"]


def materialise(prefix: str, sub: nn.Module, device: torch.device, init_fn, locations) -> None:
    """[Note: materialising meta modules] for one submodule's own tensors. ``locations`` maps
    id(parameter) -> where it is registered; a replaced parameter's entry moves to its successor."""
    meta_params = [(n, p) for n, p in sub._parameters.items() if p is not None and p.is_meta]
    meta_buffers = [(n, b) for n, b in sub._buffers.items() if b is not None and b.is_meta]
    if not meta_params and not meta_buffers:
        return
    if init_fn is None and not callable(getattr(sub, "reset_parameters", None)):
        names = [n for n, _ in meta_params + meta_buffers]
        raise ShardingError(
            f"submodule '{prefix or '<root>'}' ({type(sub).__name__}) is on the meta device "
            f"({', '.join(names)}) but has no reset_parameters() to initialise it; pass "
            f"init_fn=<callable(module)> to zbuf.shard"
        )
    for n, p in meta_params:
        new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        locs = locations.pop(id(p))
        for _, owner, name in locs:
            owner._parameters[name] = new
        locations[id(new)] = locs
    for n, b in meta_buffers:
        sub._buffers[n] = torch.empty_like(b, device=device)
    if init_fn is not None:
        init_fn(sub)
    else:
        sub.reset_parameters()
