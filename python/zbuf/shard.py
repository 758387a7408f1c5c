"""``zbuf.shard``: turn a module's parameters into ZeRO-3 shards, gathered on access.

After ``shard(module)`` every parameter is a flat, padded, 1-D ``nn.Parameter`` holding this rank's
slice ([Note: shard layout] in ``param.py``), registered under its original name, so optimizers,
``named_parameters()``, ``zero_grad`` and ``state_dict()`` keys are those of the unsharded model.
Reading ``module.weight`` returns the full tensor, produced by ``torch.ops.zbuf.all_gather`` into a
gather-buffer pool block; its backward reduce-scatters the gradient into ``shard.grad``.

[Note: parameter access through a property]
Each module class that holds parameters gets one dynamically created subclass per set of sharded
names (``Linear`` -> ``ZbufLinear``), with a ``property`` per sharded name; the instance's
``__class__`` is swapped to it. Attribute lookup finds the data descriptor before
``nn.Module.__getattr__``, so ``self.weight`` inside the unchanged ``forward`` gathers, while
``_parameters["weight"]`` still holds the shard. Dynamo traces the property (``fullgraph=True``
works) and guards only on the shards, so evaluating guards never gathers (the alternatives fail
under Dynamo: a forward pre-hook writing ``__dict__`` breaks graphs, ``parametrize`` renames keys
and adds guards).

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

import itertools
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import ops as _ops  # registers torch.ops.zbuf.*
from . import reduce_once, regather, runtime
from .param import ShardSpec, local_shard_of, shard_numel_for

__all__ = [
    "shard",
    "gathered_by_caller",
    "ShardingError",
    "ShardedRoot",
    "gather_param",
    "is_sharded",
    "sharded_parameters",
    "root_of",
    "roots",
]

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - torch built without distributed
    _FSDPModule = None

# process-wide, so ids are unique across models; rank-invariant as long as every rank shards the
# same modules in the same order (SPMD), which collective-order checks rely on.
_param_ids = itertools.count()


class ShardingError(ValueError):
    """A module, group or option that ``zbuf.shard`` (or a sharded-model helper) cannot accept."""


@dataclass
class ShardedRoot:
    """State of one ``zbuf.shard`` call, stored on the root module as ``_zbuf_root``."""

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
    hook_stack: list = field(default_factory=list)
    """Saved-tensor-hook contexts entered by nested root forwards (producer: forward pre-hook,
    consumer: forward post-hook); see [Note: eager re-gather] in ``regather.py``."""

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
    return module.__dict__.get("_zbuf_root")


def roots(model: nn.Module) -> list[ShardedRoot]:
    """The roots of every ``zbuf.shard`` call inside ``model`` (itself included), in
    ``modules()`` order."""
    return [r for m in model.modules() if (r := root_of(m)) is not None]


def gather_param(shard: nn.Parameter, spec: ShardSpec, *, track_for_backward: bool = True) -> torch.Tensor:
    """The full tensor of a sharded parameter (the body of the parameter property)."""
    if torch.compiler.is_compiling():
        return torch.ops.zbuf.all_gather(
            shard, spec.param_id, list(spec.shape), spec.group_name, spec.param_dtype, spec.reduce_dtype,
            spec.pool_id,
        )
    # [Note: eager fast path] in ops.py; [Note: reduce once] in reduce_once.py
    recorded = torch.is_grad_enabled() and shard.requires_grad
    generation = reduce_once.count_use(spec) if recorded else None
    full = _ops.EagerAllGather.apply(shard, spec, generation)
    if track_for_backward and torch.is_grad_enabled():
        regather.track(full, shard, spec)
    return full


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule holds zbuf shards."""
    return any("_zbuf_specs" in m.__dict__ for m in module.modules())


def sharded_parameters(module: nn.Module):
    """Yield ``(fqn, submodule, local_name, shard, spec)`` for every sharded name, tied ones too."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        specs = sub.__dict__.get("_zbuf_specs")
        if not specs:
            continue
        for name, spec in specs.items():
            fqn = f"{prefix}.{name}" if prefix else name
            yield fqn, sub, name, sub._parameters[name], spec


# ---------------------------------------------------------------------------------------------
# [Note: parameter access through a property]

_SUBCLASS_CACHE: dict[tuple[type, frozenset], type] = {}


# [Note: weights gathered by the caller]
# A block compiled once as a nested compile region (compile/regions.py) must not gather inside
# its body: the body is traced once for all blocks, and a gather bakes in its parameter's id.
# So the caller gathers the block's parameters in the outer graph and hands the full tensors to
# the body, which reads them here instead of gathering: while the region is traced, the top of
# this stack maps param_id -> the body's input for that parameter. It is pushed and popped only
# by code that Dynamo traces (the region body), so at run time, eager or compiled, it is empty
# and parameter access gathers as always.
_GATHERED_BY_CALLER: list[dict[int, torch.Tensor]] = []


class gathered_by_caller:
    """``with gathered_by_caller(ids, tensors):`` parameter access inside returns
    ``tensors[i]`` for parameter id ``ids[i]`` instead of gathering (see [Note: weights gathered
    by the caller]); for code traced by ``torch.compile`` only."""

    def __init__(self, param_ids, tensors) -> None:
        self.mapping = dict(zip(param_ids, tensors))

    def __enter__(self) -> None:
        _GATHERED_BY_CALLER.append(self.mapping)

    def __exit__(self, *exc) -> None:
        _GATHERED_BY_CALLER.pop()


def _make_property(name: str) -> property:
    def fget(self):
        spec = self._zbuf_specs[name]
        if _GATHERED_BY_CALLER:  # [Note: weights gathered by the caller]
            full = _GATHERED_BY_CALLER[-1].get(spec.param_id)
            if full is not None:
                return full
        return gather_param(self._parameters[name], spec)

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


def _sharded_class(cls: type, names: frozenset) -> type:
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
        if "_zbuf_specs" in sub.__dict__ or "_zbuf_root" in sub.__dict__:
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
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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
        return torch.device("cuda", torch.cuda.current_device()), on_meta
    return torch.device("cpu"), on_meta


# ---------------------------------------------------------------------------------------------


def _check_unchanged(module: nn.Module) -> None:
    """Every parameter under the root is still one of its shards (eager forwards only)."""
    shards = module._zbuf_root.shard_ids
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


def _enter_regather(module, args):
    if torch.compiler.is_compiling():
        return
    _check_unchanged(module)
    if not module._zbuf_root.hook_stack:
        reduce_once.new_forward()
    ctx = regather.regather_hooks()
    ctx.__enter__()
    module._zbuf_root.hook_stack.append(ctx)


def _exit_regather(module, args, output):
    if torch.compiler.is_compiling():
        return
    stack = module._zbuf_root.hook_stack
    if stack:
        stack.pop().__exit__(None, None, None)


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
    from . import state_dict as _state_dict

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
        from .pool import default_pool

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
            sub.__dict__.setdefault("_zbuf_specs", {})[name] = spec
        root.specs[spec.param_id] = spec
        root.shards[spec.param_id] = new

    with torch.no_grad():
        for prefix, sub in module.named_modules():
            if on_meta:
                _materialise(prefix, sub, device, init_fn, locations)
            for name, p in list(sub._parameters.items()):
                # locations holds exactly the live, not yet sharded parameters
                if p is not None and id(p) in locations:
                    shard_one(p)

    for sub in module.modules():
        specs = sub.__dict__.get("_zbuf_specs")
        if specs:
            sub.__class__ = _sharded_class(type(sub), frozenset(specs))
            _state_dict.install_hooks(sub)
    root.shard_ids = frozenset(id(p) for p in root.shards.values())
    module.__dict__["_zbuf_root"] = root
    module.register_forward_pre_hook(_enter_regather)
    module.register_forward_hook(_exit_regather, always_call=True)
    return module


def _materialise(prefix: str, sub: nn.Module, device: torch.device, init_fn, locations) -> None:
    """[Note: materialising meta modules] for one submodule's own tensors."""
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


class _CallableModule(types.ModuleType):
    """``zbuf.shard`` is this module and also callable as the function: ``zbuf.shard(model)``.

    The package re-exports the module (not the function) under that name, so both
    ``zbuf.shard(model, ...)`` and ``zbuf.shard.sharded_parameters(...)`` work, and
    ``import zbuf.shard as m`` gives the module (``zbuf.compile`` does the same).
    """

    def __call__(self, *args, **kwargs):
        return shard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
