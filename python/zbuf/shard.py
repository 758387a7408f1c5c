"""``zbuf.shard``: turn a module's parameters into ZeRO-3 shards, gathered on access.

After ``shard(module)`` every parameter is a flat, padded, 1-D ``nn.Parameter`` holding this rank's
slice ([Note: shard layout] in ``param.py``), registered under its original name, so optimizers,
``named_parameters()``, ``zero_grad`` and ``state_dict()`` keys are those of the unsharded model.
Reading ``module.weight`` returns the full tensor, produced by ``torch.ops.zbuf.all_gather`` into a
gather-buffer pool block; its backward reduce-scatters the gradient into ``shard.grad``.

This module is the public API and its validation; each part of what ``shard`` sets up has its own:
* ``shard_state.py``: the state left on the model and its accessors (``root_of``, ``specs_of``,
  ``sharded_parameters``, ``op_counts``), [Note: a model does not keep its group alive];
* ``param_access.py``: the class swap, [Note: parameter access through a property];
* ``materialise.py``: [Note: materialising meta modules];
* ``regather.py``: saved tensors re-gathered in backward (entered by the root's forward hooks
  below), [Note: eager re-gather];
* ``reduce_once.py``: one reduce-scatter per parameter per forward, [Note: reduce once];
* ``frame_inputs.py``: block frames' weights, [Note: weights gathered by the caller];
* ``state_dict.py``: [Note: state dict forms].
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import runtime, state_dict
from .devices import current_cuda, indexed
from .materialise import materialise
from .param import ShardSpec, local_shard_of, shard_numel_for
from .param_access import gather_param, sharded_class
from .pool import default_pool
from .shard_state import (
    ShardedRoot,
    ShardingError,
    attach_root,
    attach_spec,
    is_sharded,
    op_counts,
    root_of,
    roots,
    sharded_parameters,
    specs_of,
)

__all__ = [
    "shard",
    "ShardingError",
    "ShardedRoot",
    "gather_param",
    "is_sharded",
    "sharded_parameters",
    "root_of",
    "roots",
    "op_counts",
]

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - torch built without distributed
    _FSDPModule = None

# process-wide, so ids are unique across models; rank-invariant as long as every rank shards the
# same modules in the same order (SPMD), which collective-order checks rely on.
_param_ids = itertools.count()


# ---------------------------------------------------------------------------------------------
# validation


def _resolve_group(group) -> tuple[dist.ProcessGroup, int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError(
            "zbuf.shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first (a single process can use "
            "init_process_group('gloo', rank=0, world_size=1, store=torch.distributed.HashStore()))"
        )
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, dist.ProcessGroup):
        raise ShardingError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), got "
            f"{type(group).__name__}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ShardingError(
            "this process is not a member of the group passed to zbuf.shard; every rank that "
            "calls zbuf.shard must belong to the group (create it with dist.new_group on all ranks)"
        )
    return group, rank, group.size()


def _check_group_device(group: dist.ProcessGroup, device: torch.device) -> None:
    types = getattr(group, "_device_types", None)
    if types is None:
        return
    supported = {d.type for d in types}
    if device.type not in supported:
        backend = dist.get_backend(group)
        hint = (
            "move the module to CUDA first (module.cuda()) or pass a gloo group"
            if device.type == "cpu"
            else f"use a group whose backend handles {device.type} tensors"
        )
        raise ShardingError(
            f"the module's parameters are on {device}, but the sharding group's backend "
            f"'{backend}' only handles {sorted(supported)} tensors; {hint}"
        )


def _check_dtype(kind: str, dtype) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ShardingError(f"{kind} must be a floating-point torch.dtype or None, got {dtype!r}")


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ShardingError(f"zbuf.shard takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise ShardingError(
            "zbuf.shard got a torch.compile'd module; shard the original module first, then "
            "compile: torch.compile(zbuf.shard(model), ...)"
        )
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ShardingError(
            "zbuf.shard got a DistributedDataParallel wrapper; pass the plain module (zbuf "
            "already synchronises gradients, DDP on top would reduce them twice)"
        )
    for name, sub in module.named_modules():
        where = f"submodule '{name}'" if name else "the module"
        if specs_of(sub) is not None or root_of(sub) is not None:
            raise ShardingError(
                f"{where} is already sharded by zbuf.shard; shard a model once, at its root "
                f"(nested or repeated zbuf.shard calls are not supported)"
            )
        if _FSDPModule is not None and isinstance(sub, _FSDPModule):
            raise ShardingError(f"{where} is already sharded by FSDP (fully_shard); use one of the two")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensor
        DTensor = ()
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) or isinstance(p.data, DTensor):
            raise ShardingError(f"parameter '{name}' is a DTensor (already sharded/parallelised); zbuf.shard needs plain tensors")
        if p.grad is not None:
            raise ShardingError(
                f"parameter '{name}' already has a .grad; call model.zero_grad(set_to_none=True) "
                f"before zbuf.shard (the gradient would not match the shard)"
            )


def _pick_device(module: nn.Module, device, group) -> tuple[torch.device, bool]:
    """The shards' device and whether the module is (partly) on the meta device."""
    tensors = list(module.parameters()) + list(module.buffers())
    devices = {t.device for t in tensors}
    on_meta = any(d.type == "meta" for d in devices)
    real = {d for d in devices if d.type != "meta"}
    if len(real) > 1:
        raise ShardingError(
            f"the module's parameters and buffers are on several devices {sorted(map(str, real))}; "
            f"zbuf.shard needs one device per rank (move the module with .to(device) first)"
        )
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ShardingError(
                f"device={device} but CUDA is not available in this process (no GPU or driver); "
                f"use device='cpu' with a gloo group, or run on a machine with a GPU"
            )
        device = indexed(device)
        if real and next(iter(real)) != device:
            raise ShardingError(
                f"device={device} but the module's materialised tensors are on "
                f"{next(iter(real))}; move the module or drop the device argument"
            )
        return device, on_meta
    if real:
        return next(iter(real)), on_meta
    types = {d.type for d in getattr(group, "_device_types", [])}
    if "cuda" in types and torch.cuda.is_available():
        return current_cuda(), on_meta
    return torch.device("cpu"), on_meta


def _check_unchanged(module: nn.Module, root: ShardedRoot) -> None:
    """Every parameter under the root is still one of its shards (eager forwards only)."""
    shards = root.shard_ids
    late = [
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name, p in sub._parameters.items()
        if p is not None and id(p) not in shards
    ]
    if late:
        raise ShardingError(
            f"parameters {late} were added or replaced after zbuf.shard: they are not sharded, "
            f"so every rank would train its own copy with unsynchronised gradients. Build the "
            f"whole model (adapters, new heads) before calling zbuf.shard"
        )


# ---------------------------------------------------------------------------------------------
# the root's forward hooks (eager forwards only; the compile pass plans its own gathers)


def _enter_root_forward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    root = root_of(module)
    _check_unchanged(module, root)
    if not root.regather.in_forward():  # the outermost forward: [Note: reduce once]
        root.reduce_once.new_forward()
    root.regather.enter_forward()  # [Note: eager re-gather]


def _exit_root_forward(module: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    root_of(module).regather.exit_forward()


# ---------------------------------------------------------------------------------------------
# the public API


def shard(
    module: nn.Module,
    group: Optional[dist.ProcessGroup] = None,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    pool=None,
    device=None,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Shard every parameter of ``module`` across ``group`` in place (ZeRO-3); returns ``module``.

    Args:
        module: a materialised module (every rank must hold the same values, e.g. same seed) or
            one built on the meta device (materialised per [Note: materialising meta modules]).
        group: the process group to shard over; None: the default group. Its backend must handle
            the module's device (gloo: CPU; NCCL: CUDA).
        param_dtype: dtype the full parameters are gathered in (e.g. ``torch.bfloat16``); the
            cast happens before the collective. None: the parameter's own dtype.
        reduce_dtype: dtype gradients are reduce-scattered in. None: the gathered dtype.
        pool: a ``zbuf.pool.GatherBufferPool`` for the gathered buffers; None:
            ``zbuf.pool.default_pool(device)``.
        device: where meta-device modules are materialised; None: the current CUDA device when
            the group handles CUDA and one is present, else CPU. For materialised modules it must
            match (or be None).
        init_fn: ``init_fn(submodule)`` initialises a submodule's freshly materialised meta
            parameters and buffers; None: ``submodule.reset_parameters()``.

    Frozen parameters (``requires_grad=False``) are sharded and gathered but never reduced;
    buffers stay replicated and untouched. Tied parameters (one ``nn.Parameter`` under several
    names) stay tied: one shard, registered under every name. ``model.state_dict()`` holds this
    rank's shards under the unsharded keys; ``zbuf.full_state_dict`` gathers full tensors.
    """
    _check_module(module)
    _check_dtype("param_dtype", param_dtype)
    _check_dtype("reduce_dtype", reduce_dtype)
    group, rank, world = _resolve_group(group)
    device, on_meta = _pick_device(module, device, group)
    _check_group_device(group, device)

    # Every location of every parameter, tied ones included: id(param) -> [(fqn, sub, name)].
    locations: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub._parameters.items():
            if p is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            locations.setdefault(id(p), []).append((fqn, sub, name))
    for locs in locations.values():
        fqn, sub, name = locs[0]
        p = sub._parameters[name]
        if not p.dtype.is_floating_point and (param_dtype is not None or reduce_dtype is not None):
            raise ShardingError(
                f"parameter '{fqn}' has dtype {p.dtype}, which cannot be gathered in param_dtype "
                f"or reduced in reduce_dtype; make it a buffer (register_buffer) or drop the "
                f"mixed-precision dtypes"
            )

    if pool is None:
        pool = default_pool(device)
    root = ShardedRoot(group_ref=weakref.ref(group), world_size=world, rank=rank, device=device, pool=pool, specs={}, shards={})
    group_name = group.group_name
    pool_id = runtime.pool_id_of(pool)

    def shard_one(p: nn.Parameter) -> None:
        # popped: once replaced, p may die and its id be reused by a new object
        locs = locations.pop(id(p))
        fqn = locs[0][0]
        s = shard_numel_for(p.numel(), world)
        spec = ShardSpec(
            param_id=next(_param_ids), fqn=fqn, shape=tuple(p.shape), numel=p.numel(), shard_numel=s,
            world_size=world, rank=rank, group_name=group_name, dtype=p.dtype,
            param_dtype=param_dtype if param_dtype != p.dtype else None,
            reduce_dtype=reduce_dtype, pool_id=pool_id,
        )
        new = nn.Parameter(local_shard_of(p, s, rank, device=device), requires_grad=p.requires_grad)
        for _, sub, name in locs:
            sub._parameters[name] = new
            attach_spec(sub, name, spec, root)
        root.specs[spec.param_id] = spec
        root.shards[spec.param_id] = new

    with torch.no_grad():
        for prefix, sub in module.named_modules():
            if on_meta:
                materialise(prefix, sub, device, init_fn, locations)
            for name, p in list(sub._parameters.items()):
                # locations holds exactly the live, not yet sharded parameters
                if p is not None and id(p) in locations:
                    shard_one(p)

    for sub in module.modules():
        specs = specs_of(sub)
        if specs:
            sub.__class__ = sharded_class(type(sub), frozenset(specs))
            state_dict.install_hooks(sub)
    root.shard_ids = frozenset(id(p) for p in root.shards.values())
    attach_root(module, root)
    module.register_forward_pre_hook(_enter_root_forward)
    module.register_forward_hook(_exit_root_forward, always_call=True)
    return module


class _CallableModule(types.ModuleType):
    """``zbuf.shard`` is this module and also callable as the function: ``zbuf.shard(model)``.

    The package re-exports the module (not the function) under that name, so both
    ``zbuf.shard(model, ...)`` and ``zbuf.shard.sharded_parameters(...)`` work, and
    ``import zbuf.shard as m`` gives the module (``zbuf.compile`` does the same).
    """

    def __call__(self, *args, **kwargs):
        return shard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
