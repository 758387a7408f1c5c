"""Reading a sharded parameter gathers it: the class swap that adds a property per parameter.

[Note: parameter access through a property]
Each module class that holds parameters gets one dynamically created subclass per set of sharded
names (``Linear`` -> ``ZbufLinear``), with a ``property`` per sharded name; the instance's
``__class__`` is swapped to it. Attribute lookup finds the data descriptor before
``nn.Module.__getattr__``, so ``self.weight`` inside the unchanged ``forward`` gathers, while
``_parameters["weight"]`` still holds the shard. Dynamo traces the property (``fullgraph=True``
works) and guards only on the shards, so evaluating guards never gathers (the alternatives fail
under Dynamo: a forward pre-hook writing ``__dict__`` breaks graphs, ``parametrize`` renames keys
and adds guards).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.zbuf.*)
from .eager_ops import EagerAllGather
from .param import ShardSpec
from .frame_inputs import GATHERED_FOR_SHARDS, shard_gathered_by_caller
from .shard_state import ShardedRoot, ShardingError, owner_of

__all__ = ["gather_param", "sharded_class"]

# Keyed by class, and classes are process-wide by nature: every model whose ``Linear`` shards the
# same names shares one ``ZbufLinear`` (a fresh class per model would make ``type(m)`` differ
# between equal models and leak a class per call). Holds classes only, never a model's state.
_SUBCLASS_CACHE: dict[tuple[type, frozenset], type] = {}


def gather_param(shard: nn.Parameter, spec: ShardSpec, root: Optional[ShardedRoot] = None) -> torch.Tensor:
    """The full tensor of a sharded parameter: the ``zbuf::all_gather`` op while tracing, else
    the eager gather of the parameter's ``root`` (needed then)."""
    if torch.compiler.is_compiling():
        return _traced_gather(shard, spec)
    return _eager_gather(shard, spec, root)


def _traced_gather(shard: nn.Parameter, spec: ShardSpec) -> torch.Tensor:
    return torch.ops.zbuf.all_gather(
        shard, spec.param_id, list(spec.shape), spec.group_name, spec.param_dtype, spec.reduce_dtype,
        spec.pool_id,
    )


def _eager_gather(shard: nn.Parameter, spec: ShardSpec, root: ShardedRoot) -> torch.Tensor:
    # [Note: eager fast path] in eager_ops.py; [Note: reduce once] in reduce_once.py
    reducer = root.reduce_once
    recorded = torch.is_grad_enabled() and shard.requires_grad
    generation = reducer.count_use(spec) if recorded else None
    full = EagerAllGather.apply(shard, spec, reducer, generation)
    if torch.is_grad_enabled():
        root.regather.track(full, shard, spec)
    return full


def _make_property(name: str) -> property:
    def fget(self):
        shard = self._parameters[name]
        # A block frame's weights, looked up before the spec is read: reading its param_id
        # while tracing would guard on it ([Note: weights gathered by the caller]).
        if GATHERED_FOR_SHARDS:
            full = shard_gathered_by_caller(shard)
            if full is not None:
                return full
        spec = self._zbuf_specs[name]  # shard_state.specs_of(self), read inline: the hot path
        if torch.compiler.is_compiling():
            return _traced_gather(shard, spec)
        return _eager_gather(shard, spec, owner_of(self))

    return property(fget, doc=f"Full ``{name}``, all-gathered from this rank's shard on access.")


def _sharded_setattr(self, name, value):
    if name in type(self)._zbuf_sharded_names:
        raise ShardingError(
            f"cannot assign to '{name}' of a zbuf-sharded {type(self).__mro__[1].__name__}: it is "
            f"a view of a sharded parameter. Tie or replace parameters before zbuf.shard(), change "
            f"values in place through the shard (module._parameters['{name}']), or load a state "
            f"dict (load_state_dict accepts full tensors)"
        )
    super(type(self), self).__setattr__(name, value)


def sharded_class(cls: type, names: frozenset) -> type:
    """The subclass of ``cls`` with a gathering property per name in ``names`` ([Note: parameter
    access through a property])."""
    key = (cls, names)
    sub = _SUBCLASS_CACHE.get(key)
    if sub is None:
        attrs = {n: _make_property(n) for n in sorted(names)}
        attrs["_zbuf_sharded_names"] = names
        attrs["__setattr__"] = _sharded_setattr
        attrs["__module__"] = cls.__module__
        attrs["__doc__"] = cls.__doc__
        sub = type(f"Zbuf{cls.__name__}", (cls,), attrs)
        _SUBCLASS_CACHE[key] = sub
    return sub
