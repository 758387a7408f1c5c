"""State dicts of sharded modules: per-rank shards under unsharded keys, and full tensors.

[Note: state dict forms]
- ``model.state_dict()`` (no collective): every key of the unsharded model, each sharded
  parameter's value being this rank's flat padded shard. Each sharded submodule records the world
  size in the state dict's per-module metadata (``_metadata[prefix]["zbuf_world_size"]``), so a
  per-rank checkpoint loaded into a differently sharded model fails with a clear error instead of
  copying wrong slices. No collective on purpose: ``if rank == 0: torch.save(model.state_dict())``
  must not hang.
- ``zbuf.full_state_dict(model)`` (collective: every rank of the group must call it): the same keys
  with full tensors in the parameters' own dtype, on CPU; world-size independent.
- ``model.load_state_dict(sd)`` accepts, per sharded key, either a full tensor (this rank's slice is
  taken) or a shard saved from the same world size. ``zbuf.load_full_state_dict`` insists on full
  tensors (no collective: every rank passes the full dict, e.g. each loads the checkpoint file).
"""

from __future__ import annotations

import torch
from torch import nn

from .param import local_shard_of
from .shard_state import ShardingError, root_of, sharded_parameters, specs_of

__all__ = ["full_state_dict", "load_full_state_dict", "install_hooks"]

_WORLD_KEY = "zbuf_world_size"


def _state_dict_post_hook(module, state_dict, prefix, local_metadata) -> None:
    specs = specs_of(module)
    if specs:
        local_metadata[_WORLD_KEY] = next(iter(specs.values())).world_size


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    specs = specs_of(module) or {}
    saved_world = local_metadata.get(_WORLD_KEY) if local_metadata else None
    for name, spec in specs.items():
        key = prefix + name
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue  # load_state_dict reports the type error itself
        if tuple(value.shape) == spec.shape:
            # A full tensor. The one shape a shard shares with its full tensor is [1] (or any
            # shape at world size 1), where slicing the "full" value gives the shard itself.
            state_dict[key] = local_shard_of(value, spec.shard_numel, spec.rank, device=value.device)
            continue
        if saved_world is not None and saved_world != spec.world_size:
            raise ShardingError(
                f"'{key}': this state dict holds shards from a {saved_world}-rank zbuf.shard, but the "
                f"model is sharded over {spec.world_size} ranks; per-rank state dicts only load at "
                f"the same world size. Save with zbuf.full_state_dict() and load with "
                f"zbuf.load_full_state_dict() to change the world size"
            )
        if tuple(value.shape) != (spec.shard_numel,):
            raise ShardingError(
                f"'{key}': expected the full tensor {list(spec.shape)} or this rank's shard "
                f"[{spec.shard_numel}] (world size {spec.world_size}), got {list(value.shape)}"
                + _guess_world(value, spec)
            )


def _guess_world(value: torch.Tensor, spec) -> str:
    if value.dim() != 1 or value.numel() == 0:
        return ""
    guess = -(-spec.numel // value.numel())
    if guess != spec.world_size and -(-spec.numel // guess) == value.numel():
        return (
            f"; it looks like a shard from a {guess}-rank run. Save with zbuf.full_state_dict() "
            f"and load with zbuf.load_full_state_dict() to change the world size"
        )
    return ""


def install_hooks(module: nn.Module) -> None:
    """Register the state-dict hooks of [Note: state dict forms] on a sharded submodule."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)


def _root_of(model: nn.Module):
    root = root_of(model)
    if root is None:
        raise ShardingError(
            "this module is not the root of a zbuf.shard call; pass the module you sharded"
        )
    return root


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on CPU, keys as the unsharded model's ``state_dict()``.

    Collective: every rank of the sharding group must call it, in the same order. Parameters come
    back in their own dtype (not ``param_dtype``); tied names share one tensor, as in an unsharded
    model. With ``rank0_only=True`` only rank 0 receives the tensors (the others still take part
    in the gathers and get ``{}``), which keeps host memory on the other ranks flat.
    """
    root = _root_of(model)
    sd = model.state_dict()
    full_by_id: dict[int, torch.Tensor] = {}
    keep = not rank0_only or root.rank == 0
    for fqn, _sub, _name, shard, spec in sharded_parameters(model):
        if fqn not in sd:
            continue
        if spec.param_id not in full_by_id:
            gathered = torch.ops.zbuf.all_gather(
                shard.detach(), spec.param_id, list(spec.shape), spec.group_name, None, None,
                spec.pool_id,
            )
            # copy out of the pool buffer; the buffer goes back when `gathered` dies
            full_by_id[spec.param_id] = gathered.to("cpu", copy=True) if keep else None
            del gathered
        sd[fqn] = full_by_id[spec.param_id]
    if not keep:
        return {}
    for meta in getattr(sd, "_metadata", {}).values():
        meta.pop(_WORLD_KEY, None)  # full values are world-size independent
    for key, value in sd.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            sd[key] = value.cpu()
    return sd


def load_full_state_dict(model: nn.Module, state_dict, *, strict: bool = True):
    """Load full (unsharded) tensors into a sharded model; each rank keeps its slice.

    No collective: every rank passes the full state dict. Returns ``load_state_dict``'s result.
    Raises ``ShardingError`` for a sharded (per-rank) value, naming the world size it came from.
    """
    _root_of(model)
    for fqn, _sub, _name, _shard, spec in sharded_parameters(model):
        value = state_dict.get(fqn)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != spec.shape:
            raise ShardingError(
                f"'{fqn}': load_full_state_dict expects the full tensor {list(spec.shape)}, got "
                f"{list(value.shape)}" + _guess_world(value, spec)
            )
    return model.load_state_dict(state_dict, strict=strict)
