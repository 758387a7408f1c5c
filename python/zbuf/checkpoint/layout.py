"""How a zbuf-sharded model and its optimizer map onto a DCP state dict, and back.

[Note: checkpoint layout]
A sharded parameter of ``numel`` elements is saved as one *flat* global tensor of ``(numel,)``
elements: this rank's shard without its padding is exactly the ``torch.chunk`` slice
``[rank * s, min((rank + 1) * s, numel))`` of the flattened parameter ([Note: shard layout] in
``param.py``), which is what DTensor's ``Shard(0)`` placement means for an uneven split. So the
unpadded slice (a view of the shard, no copy) wrapped by ``DTensor.from_local(..., shape=(numel,),
stride=(1,), placements=[Shard(0)])`` on a 1-D DeviceMesh over the sharding group tells DCP which
chunk of the global tensor each rank holds; each rank writes only its own bytes (no rank ever
holds the full model) and loading into any other world size reads the overlapping chunks. Ranks
whose slice is empty (``numel < world``) contribute an empty chunk.

Optimizer state that has the shard's shape (AdamW's ``exp_avg`` / ``exp_avg_sq``, momentum
buffers) is saved the same way, so it reshards too; padding positions hold zeros (zero gradient,
zero state) and are not saved. Any other tensor state (AdamW's scalar ``step``) must be the same
on every rank and is saved once, as a replicated tensor. Non-tensor state and the param groups
(hyperparameters, with parameters named by FQN instead of index) are saved as serialised bytes.

DCP keys (flat, so DCP's own flattening leaves them as they are):
``model.<fqn>``, ``buffer.<fqn>``, ``optim.<fqn>.<state key>``, ``optim.param_groups``, ``extra``.
The manifest (``files.MANIFEST_NAME``) describes the same entries with full shapes, so a
load can validate everything before it touches the model.
"""

from __future__ import annotations

import io
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..param import ShardSpec
from ..shard_state import root_of, sharded_parameters
from .errors import LayoutError

__all__ = ["ParamEntry", "ModelInventory", "inventory", "param_view", "serialise", "deserialise",
           "optimizer_entries", "optimizer_destinations", "optimizer_state_dict"]

PARAM_GROUPS_KEY = "optim.param_groups"
EXTRA_KEY = "extra"


def model_key(fqn: str) -> str:
    return f"model.{fqn}"


def buffer_key(fqn: str) -> str:
    return f"buffer.{fqn}"


def optim_key(fqn: str, state_key: str) -> str:
    return f"optim.{fqn}.{state_key}"


class ParamEntry(NamedTuple):
    """One sharded parameter as the checkpoint sees it (tied names collapse to the first)."""

    fqn: str
    shard: nn.Parameter
    spec: ShardSpec
    aliases: tuple[str, ...]
    """Other names of the same (tied) parameter."""

    @property
    def local_numel(self) -> int:
        """Elements of the unpadded slice this rank holds (0 when all of it is padding)."""
        spec = self.spec
        start = min(spec.rank * spec.shard_numel, spec.numel)
        return min(start + spec.shard_numel, spec.numel) - start


class ModelInventory(NamedTuple):
    params: dict[str, ParamEntry]
    """FQN (first name) -> entry, in ``named_parameters`` order."""
    buffers: dict[str, torch.Tensor]
    """Persistent buffers, replicated on every rank."""
    group: dist.ProcessGroup
    device: torch.device


def inventory(model: nn.Module) -> ModelInventory:
    """Every sharded parameter and persistent buffer of a ``zbuf.shard``-ed model.

    Raises ``LayoutError`` for a model that was not sharded, or has parameters that are not zbuf
    shards (added after ``zbuf.shard``): saving those would store one rank's private copy.
    """
    root = root_of(model)
    if root is None:
        raise LayoutError(
            f"{type(model).__name__} is not a zbuf-sharded model (no zbuf.shard state on it); "
            f"zbuf checkpoints save sharded models: call zbuf.shard(model) first, and pass the "
            f"module zbuf.shard returned (for a torch.compile'd model pass the original module, "
            f"compiled._orig_mod)"
        )
    params: dict[str, ParamEntry] = {}
    by_id: dict[int, str] = {}
    for fqn, _sub, _name, shard, spec in sharded_parameters(model):
        first = by_id.get(spec.param_id)
        if first is None:
            by_id[spec.param_id] = fqn
            params[fqn] = ParamEntry(fqn, shard, spec, ())
        else:
            e = params[first]
            params[first] = e._replace(aliases=e.aliases + (fqn,))
    shard_ids = {id(e.shard) for e in params.values()}
    strays = [n for n, p in model.named_parameters() if id(p) not in shard_ids]
    if strays:
        raise LayoutError(
            f"parameter(s) {strays[:5]} of the model are not zbuf shards: they were added or "
            f"replaced after zbuf.shard(), so each rank holds its own unsynchronised copy. Add "
            f"every parameter before calling zbuf.shard (build the whole model, then shard it)"
        )
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {}
    non_persistent = set()
    for prefix, sub in model.named_modules():
        for bname in getattr(sub, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{prefix}.{bname}" if prefix else bname)
    for fqn, buf in model.named_buffers():
        if fqn not in non_persistent and fqn not in names:
            buffers[fqn] = buf
    return ModelInventory(params, buffers, root.group, root.device)


def mesh_for(group: dist.ProcessGroup, device: torch.device):
    """A 1-D DeviceMesh over ``group``, built per save or load and dropped with it: a cached mesh
    would keep the group alive after ``destroy_process_group()`` ([Note: a model does not keep
    its group alive] in ``shard_state.py``)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def flat_dtensor(local: torch.Tensor, numel: int, mesh):
    """[Note: checkpoint layout]: the 1-D global tensor of ``numel`` elements this slice belongs
    to, around ``local`` itself wherever it is.

    Built as ``DTensor.from_local(..., run_check=False)`` builds it, less its move of ``local``
    to the mesh's device type: the optimizer state a ``StepOffload`` keeps in host memory is
    written from there and read back into it ([Note: loading streamed state] in
    zbuf/optimizer_step_offload.py); moved, all of it would be on the device at once, the state
    offloaded because it does not fit there. DCP reads only the placement and shapes of a
    DTensor and copies the bytes into (or out of) its local tensor on the host."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, (Shard(0),),
                       tensor_meta=TensorMeta(torch.Size((numel,)), (1,), local.dtype))
    return DTensor(local.view_as(local), spec, requires_grad=False)


def param_view(entry: ParamEntry, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unpadded slice of ``tensor`` (default: the shard), detached, sharing its memory."""
    t = entry.shard if tensor is None else tensor
    return t.detach()[: entry.local_numel]


def is_shard_shaped(value: Any, entry: ParamEntry) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (entry.spec.shard_numel,) and value.dim() == 1


def serialise(obj: Any, what: str) -> bytes:
    """``obj`` as bytes that ``torch.load(weights_only=True)`` reads back; fails now, not at load."""
    try:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - the message says what is wrong with obj
        raise LayoutError(
            f"{what} cannot be stored in a checkpoint: it holds objects that torch.load("
            f"weights_only=True) refuses ({e}). Use plain Python values (dict, list, tuple, str, "
            f"int, float, bool, None) and tensors"
        ) from None
    return data


def deserialise(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def optimizer_param_fqns(optimizer: torch.optim.Optimizer, inv: ModelInventory) -> list[list[str]]:
    """Per param group, the FQNs of its parameters (in the group's order)."""
    fqn_of = {id(e.shard): e.fqn for e in inv.params.values()}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            name = fqn_of.get(id(p))
            if name is None:
                raise LayoutError(
                    f"optimizer param group {gi} holds a parameter (shape {tuple(p.shape)}) that is "
                    f"not a sharded parameter of this model; build the optimizer after zbuf.shard "
                    f"from model.parameters()"
                )
            names.append(name)
        groups.append(names)
    return groups


# ---------------------------------------------------------------------------------------------
# the optimizer


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


Home = Callable[[nn.Parameter, str, torch.dtype], Optional[torch.Tensor]]
"""(shard, state key, saved dtype) -> the host tensor of the shard's shape that state is read
into, or None (``StepOffload.load_home``)."""


def optimizer_entries(inv: ModelInventory, optimizer, mesh) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's DCP entries (shard-shaped state as flat DTensors, other tensors
    replicated, the rest serialised: [Note: checkpoint layout]) and their manifest section."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise LayoutError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    group_fqns = optimizer_param_fqns(optimizer, inv)
    osd = optimizer.state_dict()
    index_to_fqn = [fqn for names in group_fqns for fqn in names]
    state: dict[str, Any] = {}
    state_md: dict[str, dict] = {}
    for index, per_param in osd["state"].items():
        fqn = index_to_fqn[index]
        e = inv.params[fqn]
        md = {}
        for k, v in per_param.items():
            key = optim_key(fqn, k)
            if is_shard_shaped(v, e):
                state[key] = flat_dtensor(param_view(e, v), e.spec.numel, mesh)
                md[k] = {"kind": "shard", "dtype": str(v.dtype).removeprefix("torch.")}
            elif isinstance(v, torch.Tensor):
                state[key] = v.detach()
                md[k] = {"kind": "replicated", "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            else:
                state[key] = serialise(v, f"optimizer state '{k}' of '{fqn}'")
                md[k] = {"kind": "object"}
        state_md[fqn] = md
    groups = [dict(g, params=names) for g, names in zip(osd["param_groups"], group_fqns)]
    state[PARAM_GROUPS_KEY] = serialise(groups, "the optimizer's param groups")
    return state, {
        "class": type(optimizer).__qualname__,
        "param_groups": group_fqns,
        "state": state_md,
    }


def optimizer_destinations(saved: dict[str, Any], inv: ModelInventory, mesh,
                           state: dict[str, Any], home: Optional[Home] = None
                           ) -> dict[str, dict[str, Any]]:
    """Adds to ``state`` the DCP entries the optimizer's saved state (``saved``: its manifest
    section) is read into: fresh tensors, as the optimizer's own state may not exist yet, and
    placeholders for serialised values. Returns, per FQN, where each state key's value lands
    (a tensor, or the DCP key of its serialised bytes). ``home``: where the optimizer keeps a
    shard's state in host memory, read straight there ([Note: loading streamed state] in
    zbuf/optimizer_step_offload.py); elsewhere it is read onto the model's device."""
    optim_dest: dict[str, dict[str, Any]] = {}
    for fqn, per_param in saved["state"].items():
        e = inv.params[fqn]
        dest = {}
        for k, md in per_param.items():
            key = optim_key(fqn, k)
            if md["kind"] == "shard":
                dtype = _DTYPES[md["dtype"]]
                t = None if home is None else home(e.shard, k, dtype)
                if t is None:
                    t = torch.zeros(e.spec.shard_numel, dtype=dtype, device=inv.device)
                else:
                    t[e.local_numel:].zero_()  # the padding, which is not saved
                state[key] = flat_dtensor(param_view(e, t), e.spec.numel, mesh)
                dest[k] = t
            elif md["kind"] == "replicated":
                # optimizer.load_state_dict moves state to the device its policy wants
                state[key] = dest[k] = torch.empty(md["shape"], dtype=_DTYPES[md["dtype"]])
            else:
                state[key] = b""
                dest[k] = key
        optim_dest[fqn] = dest
    state[PARAM_GROUPS_KEY] = b""
    return optim_dest


def optimizer_state_dict(state: dict[str, Any], optim_dest: dict[str, dict[str, Any]]) -> dict:
    """The ``optimizer.load_state_dict`` argument, from what DCP read into ``state`` and
    ``optimizer_destinations``'s ``optim_dest`` (param groups name their parameters by FQN in the
    checkpoint, by index in the state dict)."""
    saved_groups = deserialise(state[PARAM_GROUPS_KEY])
    index_of: dict[str, int] = {}
    groups = []
    for g in saved_groups:
        indices = []
        for fqn in g["params"]:
            index_of[fqn] = len(index_of)
            indices.append(index_of[fqn])
        groups.append(dict(g, params=indices))
    per_index = {}
    for fqn, dest in optim_dest.items():
        per_index[index_of[fqn]] = {
            k: deserialise(state[v]) if isinstance(v, str) else v for k, v in dest.items()
        }
    return {"state": per_index, "param_groups": groups}
