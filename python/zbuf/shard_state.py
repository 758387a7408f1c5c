"""What a ``zbuf.shard`` call leaves on a model, and the one accessor per kind of it.

Two records, both in the modules' ``__dict__`` (so ``nn.Module.__getattr__`` never sees them and
Dynamo reads them as plain attributes), written only here:

* the *root* (the module ``zbuf.shard`` was called on) holds its ``ShardedRoot``: read it with
  ``root_of(module)`` (``roots(model)`` for every root inside a model);
* every submodule that holds shards maps each sharded local name to its ``ShardSpec``: read it
  with ``specs_of(module)`` (``sharded_parameters(model)`` walks them all), and reaches the
  ``ShardedRoot`` it belongs to with ``owner_of(module)``.

What the ops did for a model's parameters is on its roots too: ``op_counts(model)``.

As FSDP2's ``fully_shard.state(module)``: other modules go through these accessors, never through
the attribute names.

[Note: a model does not keep its group alive]
``destroy_process_group()`` drops torch's references to its groups; a gloo group is freed (and
its ``pt_gloo_runloop`` threads joined) only when no other reference is left. A group still
referenced at interpreter exit keeps those threads running into finalisation, where a thread
that releases a finished collective's tensor needs the GIL, is ``pthread_exit``-ed by the
finalising interpreter, and the forced unwind through a ``noexcept`` destructor kills the
process with SIGABRT after all its work succeeded (observed on torch 2.11, about 5 runs in 6 of
a 2-rank job). So a sharded model holds its group weakly (``ShardedRoot.group_ref``): scripts
that keep the model alive past ``destroy_process_group()`` exit cleanly, and using the model
after that is a clear error. Nothing else in zbuf keeps a group or a DeviceMesh beyond the call
that needs it (``tests/test_exit.py`` checks that no gloo thread survives destroy).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import runtime
from .param import ShardSpec
from .reduce_once import ReduceOnce
from .regather import Regather

__all__ = [
    "ShardingError",
    "ShardedRoot",
    "root_of",
    "roots",
    "specs_of",
    "owner_of",
    "op_counts",
    "is_sharded",
    "sharded_parameters",
    "attach_root",
    "attach_spec",
]

_ROOT_KEY = "_zbuf_root"
_SPECS_KEY = "_zbuf_specs"  # also read as ``self._zbuf_specs`` by the parameter property
_OWNER_KEY = "_zbuf_owner"


class ShardingError(ValueError):
    """A module, group or option that ``zbuf.shard`` (or a sharded-model helper) cannot accept."""


@dataclass
class ShardedRoot:
    """State of one ``zbuf.shard`` call, stored on the root module (``root_of``)."""

    group_ref: weakref.ReferenceType
    """The sharding group, weakly: [Note: a model does not keep its group alive]. Read it
    through ``group``."""
    world_size: int
    """``group.size()``."""
    rank: int
    """This process's rank in ``group``."""
    device: torch.device
    """Where shards and gathered buffers live."""
    pool: object
    """The gather-buffer pool every parameter of this root draws from."""
    specs: dict[int, ShardSpec]
    """param_id -> spec, in the order parameters were sharded (``named_parameters`` order)."""
    shards: dict[int, nn.Parameter]
    """param_id -> the shard parameter."""
    shard_ids: frozenset = frozenset()
    """ids of the shard parameters (alive as long as ``shards`` holds them): the eager forward
    checks that no parameter was added or replaced after sharding."""
    regather: Regather = field(default_factory=Regather)
    """The eager forwards' saved-tensor hooks: [Note: eager re-gather] in ``regather.py``."""
    counters: collections.Counter = field(default_factory=collections.Counter)
    """What the ops did for this root's parameters ([Note: counts live with their model] in
    runtime.py; read with ``op_counts``): ``all_gather`` and ``all_gather_bytes`` (gathers and
    the bytes of their padded buffers), ``reduce_scatter`` and ``reduce_scatter_bytes``
    (reduce-scatters and the bytes of their padded inputs), eager gradient contributions held
    for a later reduction (``grad_accumulate``) and reductions made at the end of a backward
    (``reduce_scatter_flush``, also counted in ``reduce_scatter``): [Note: reduce once]."""
    steps_in_backward: bool = False
    """An optimizer updates these shards in backward and drops their gradients there
    ([Note: optimizer in backward] in optimizer_in_backward.py): nothing is left to clip."""
    reduce_once: ReduceOnce = field(init=False)
    """The eager backwards' gradient reductions: [Note: reduce once] in ``reduce_once.py``."""

    def __post_init__(self) -> None:
        self.reduce_once = ReduceOnce(self.counters)

    @property
    def group(self) -> dist.ProcessGroup:
        """The sharding group; ``ShardingError`` once it has been destroyed."""
        group = self.group_ref()
        if group is None:
            raise ShardingError(
                "the process group this model was sharded over has been destroyed "
                "(torch.distributed.destroy_process_group); a sharded model cannot communicate "
                "without it. Save what you need (zbuf.save_checkpoint, zbuf.full_state_dict) "
                "before destroying the group"
            )
        return group

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of gathering every parameter once (padded), the pool's worst case."""
        return sum(s.gathered_nbytes for s in self.specs.values())


def root_of(module: nn.Module) -> Optional[ShardedRoot]:
    """The state of the ``zbuf.shard`` call made on ``module`` itself; None when ``module`` is not
    such a root (never sharded, or a submodule of a sharded model)."""
    return module.__dict__.get(_ROOT_KEY)


def roots(model: nn.Module) -> list[ShardedRoot]:
    """The roots of every ``zbuf.shard`` call inside ``model`` (itself included), in
    ``modules()`` order."""
    return [r for m in model.modules() if (r := root_of(m)) is not None]


def specs_of(module: nn.Module) -> Optional[dict[str, ShardSpec]]:
    """Local parameter name -> spec of the shards ``module`` itself holds; None if it holds none."""
    return module.__dict__.get(_SPECS_KEY)


def owner_of(module: nn.Module) -> Optional[ShardedRoot]:
    """The root whose ``zbuf.shard`` call sharded ``module``'s own parameters; None if none did."""
    return module.__dict__.get(_OWNER_KEY)


def op_counts(model: nn.Module) -> collections.Counter:
    """What zbuf's ops did for the parameters of every root inside ``model`` (a compiled model
    too), summed into a new counter: the keys of ``ShardedRoot.counters``. Another model's ops
    are not in it ([Note: counts live with their model] in runtime.py)."""
    total = collections.Counter()
    for root in roots(model):
        total.update(root.counters)
    return total


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule holds zbuf shards."""
    return any(_SPECS_KEY in m.__dict__ for m in module.modules())


def sharded_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter, ShardSpec]]:
    """Yield ``(fqn, submodule, local_name, shard, spec)`` for every sharded name, tied ones too."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        specs = specs_of(sub)
        if not specs:
            continue
        for name, spec in specs.items():
            fqn = f"{prefix}.{name}" if prefix else name
            yield fqn, sub, name, sub._parameters[name], spec


def attach_spec(sub: nn.Module, name: str, spec: ShardSpec, root: ShardedRoot) -> None:
    """Record that ``sub``'s parameter ``name`` is the shard ``spec`` describes, of ``root``."""
    sub.__dict__.setdefault(_SPECS_KEY, {})[name] = spec
    sub.__dict__[_OWNER_KEY] = root


def attach_root(module: nn.Module, root: ShardedRoot) -> None:
    """Record ``root`` as the state of the ``zbuf.shard`` call made on ``module``; from now on its
    parameters' gathers and reduce-scatters count into ``root.counters``."""
    module.__dict__[_ROOT_KEY] = root
    runtime.count_into(root.specs, root.counters)
