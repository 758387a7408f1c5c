"""Saving and loading: sharded, atomic, verified checkpoints of zbuf models and optimizers (DCP).

::

    zbuf.save_checkpoint(zbuf.checkpoint_path(root, step), model, optimizer, step=step)
    ...
    info = zbuf.load_checkpoint(root, model, optimizer)   # the latest complete one under root
    start = info.step

Both are collectives over the model's sharding group: every rank calls them with the same path.

- Sharded: each rank writes and reads only its own slices ([Note: checkpoint layout] in
  ``layout.py``); no rank ever materialises a full parameter. Loading into another
  world size reshards (DCP reads the overlapping chunks).
- Bit-exact: parameters and optimizer state come back with the bytes they were saved with (the
  same dtype; a different model dtype is cast by DCP's copy).
- Atomic: [Note: atomic checkpoint commit] in ``files.py``.
- Verified before anything is touched: [Note: validate, then load].

[Note: validate, then load]
``load_checkpoint`` changes the model and optimizer only after every check passed on every rank:
the manifest parses; every file has its recorded size and CRC ([Note: checkpoint integrity]);
DCP's metadata reads; the checkpoint's parameters, buffers and shapes equal the model's (missing,
unexpected and mis-shaped keys are listed together); the optimizer's class and param groups equal
the saved ones. Each check ends in one collective that shares every rank's verdict, so all ranks
raise the same error or none does. Then DCP reads straight into the parameters (no staging copy:
a staging copy would double the shard memory at load time). What remains possible after
validation is an I/O error in the middle of the read itself, which leaves the model partly
loaded: the error says so, and the fix is to load again.

[Note: what is not in a checkpoint]
RNG states, data-loader position, learning-rate schedulers and gradient-accumulation state are the
caller's: pass them in ``extra`` (any value ``torch.load(weights_only=True)`` reads back: plain
Python containers, numbers, strings, tensors). zbuf's own training data is a pure function of the
step (``zbuf.train.data``), which is why ``step`` is enough to resume it bit-exactly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from .. import faults
from ..optimizer_step_offload import streamed_state_of
from . import files, layout
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LayoutError,
)
from .files import latest_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "read_checkpoint_info",
    "CheckpointInfo",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
"""Version of the manifest and DCP key layout; bumped on incompatible changes."""

_MAX_LISTED = 8


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load_checkpoint`` (or ``read_checkpoint_info``) found."""

    path: Path
    """The checkpoint directory that was read (resolved from a root: the latest one)."""
    step: int
    """The ``step`` passed to ``save_checkpoint``."""
    world_size: int
    """Ranks that saved it (the loading world size may differ)."""
    extra: Any
    """The ``extra`` passed to ``save_checkpoint`` (None if none; not read by ``read_checkpoint_info``)."""
    created_unix: float
    """When the save committed (seconds since the epoch)."""
    has_optimizer: bool
    """Whether optimizer state was saved."""
    run: Optional[dict] = None
    """The ``run`` passed to ``save_checkpoint`` (None if none): what run the state belongs to."""


# ---------------------------------------------------------------------------------------------
# collective helpers: every rank learns every rank's verdict


def _agree(group: dist.ProcessGroup, problem: Optional[str]) -> list[tuple[int, str]]:
    """All ranks' problems as ``(rank, message)``; one ``all_gather_object``."""
    out: list[Optional[str]] = [None] * group.size()
    dist.all_gather_object(out, problem, group=group)
    return [(r, p) for r, p in enumerate(out) if p]


def _from_rank0(group: dist.ProcessGroup, value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


# ---------------------------------------------------------------------------------------------
# save


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: int,
    extra: Any = None,
    run: Optional[dict] = None,
) -> Path:
    """Save ``model``'s shards (and ``optimizer``'s state) to the directory ``path``, atomically.

    Collective over the model's sharding group; every rank passes the same ``path``. Returns the
    committed directory. A checkpoint belongs to the run that saved it ([Note: checkpoints
    belong to one run] in ``zbuf/train/save_resume.py``, the rule ``zbuf train`` follows): an
    existing checkpoint at ``path`` is replaced only by a save that passes ``run`` with that
    checkpoint's ``run["id"]``, atomically (a save that dies midway leaves what was there before,
    [Note: atomic checkpoint commit]); any other save there (a second run of the same script)
    raises ``CheckpointMismatchError`` before anything is written.

    Args:
        path: the checkpoint directory; ``zbuf.checkpoint_path(root, step)`` gives the
            conventional ``root/step_<N>`` that ``latest_checkpoint(root)`` finds.
        model: the module ``zbuf.shard`` returned (or its ``torch.compile`` wrapper).
        optimizer: an optimizer over the model's parameters, or None to save the model only.
        step: the training step this state belongs to (a non-negative int, the same on every
            rank); returned by ``load_checkpoint``.
        extra: anything else to resume with ([Note: what is not in a checkpoint]); must be the
            same on every rank (DCP stores one rank's copy).
        run: a JSON-serialisable dict describing the run this state belongs to (``zbuf train``
            records its run id and configuration: [Note: checkpoints belong to one run] in
            ``zbuf/train/save_resume.py``). Kept in the manifest, so ``read_checkpoint_info``
            returns it without loading anything; rank 0's copy is stored. Its ``"id"``, when
            present, is what lets a later save of the same run replace this checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise LayoutError(f"step must be a non-negative int, got {step!r}")
    if run is not None:
        try:
            if not isinstance(run, dict):
                raise TypeError(f"a {type(run).__name__}")
            json.dumps(run)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"run must be a JSON-serialisable dict (plain str, int, float, bool, "
                              f"None, lists and dicts), got {e}") from None
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    path = Path(path)
    with record_function("zbuf::checkpoint::collect"):
        inv = layout.inventory(model)
        group = inv.group
        rank, world = dist.get_rank(group), group.size()
        state, manifest = _save_state(inv, optimizer, extra)
    manifest.update(step=step, world_size=world, run=run)

    with record_function("zbuf::checkpoint::prepare"):
        problem = _someone_elses(path, run) if rank == 0 else None
        _raise_if_any(group, problem, CheckpointMismatchError, f"not saving {path}")
        if rank == 0:
            try:
                files.prepare_tmp_dir(path)
            except Exception as e:  # noqa: BLE001 - shared with every rank, see _raise_if_any
                problem = f"cannot create the temporary directory next to {path}: {type(e).__name__}: {e}"
        _raise_if_any(group, problem, CheckpointError, f"saving {path} failed before writing")
    tmp = files.tmp_dir_for(path)

    with record_function("zbuf::checkpoint::write"):
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group)
    faults.fault_point("checkpoint.after_data")

    with record_function("zbuf::checkpoint::checksum"):
        try:
            listed: list[str] | str | None = files.data_files(tmp) if rank == 0 else None
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            listed = f"listing {tmp} failed: {type(e).__name__}: {e}"
        names = _from_rank0(group, listed)
        if isinstance(names, str):
            raise CheckpointError(f"saving {path} failed; the previous checkpoint is intact: rank 0: {names}")
        try:
            mine: dict | str = {n: list(files.file_record(tmp / n)) for i, n in enumerate(names) if i % world == rank}
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            mine = f"reading back what was written failed: {type(e).__name__}: {e}"
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, mine, group=group)
        failed = [(r, s) for r, s in enumerate(shares) if isinstance(s, str)]
        if failed:
            raise CheckpointError(f"saving {path} failed; the previous checkpoint is intact: "
                                  + "; ".join(f"rank {r}: {s}" for r, s in failed))

    with record_function("zbuf::checkpoint::commit"):
        problem = None
        if rank == 0:
            try:
                manifest["files"] = {n: rec for share in shares for n, rec in share.items()}
                manifest["created_unix"] = time.time()
                files.write_json_durably(tmp / files.MANIFEST_NAME, manifest)
                faults.fault_point("checkpoint.before_commit")
                files.commit(tmp, path)
            except Exception as e:  # noqa: BLE001 - shared with every rank, see _raise_if_any
                problem = f"committing {tmp} as {path} failed: {type(e).__name__}: {e}"
        _raise_if_any(group, problem, CheckpointError, f"saving {path} failed; the previous checkpoint is intact")
    return path


def _save_state(inv: layout.ModelInventory, optimizer, extra) -> tuple[dict, dict]:
    """The DCP state dict (views of live tensors, no copies) and the manifest describing it."""
    mesh = layout.mesh_for(inv.group, inv.device)
    state: dict[str, Any] = {}
    params_md = {}
    for fqn, e in inv.params.items():
        state[layout.model_key(fqn)] = layout.flat_dtensor(layout.param_view(e), e.spec.numel, mesh)
        params_md[fqn] = {"shape": list(e.spec.shape), "dtype": str(e.shard.dtype).removeprefix("torch."),
                          "aliases": list(e.aliases)}
    buffers_md = {}
    for fqn, buf in inv.buffers.items():
        state[layout.buffer_key(fqn)] = buf.detach()
        buffers_md[fqn] = {"shape": list(buf.shape), "dtype": str(buf.dtype).removeprefix("torch.")}
    manifest: dict[str, Any] = {
        "format": "zbuf-checkpoint",
        "version": FORMAT_VERSION,
        "torch_version": torch.__version__,
        "model": {"params": params_md, "buffers": buffers_md},
        "optimizer": None,
        "has_extra": extra is not None,
    }
    if optimizer is not None:
        optim_state, manifest["optimizer"] = layout.optimizer_entries(inv, optimizer, mesh)
        state.update(optim_state)
    if extra is not None:
        state[layout.EXTRA_KEY] = layout.serialise(extra, "extra")
    return state, manifest


def _someone_elses(path: Path, run: Optional[dict]) -> Optional[str]:
    """Why a save of ``run`` must not replace what is at ``path`` (None: nothing there, or a
    checkpoint of the same run id); read by rank 0 only."""
    existing = files.standing_checkpoint(path)
    if existing is None:
        return None
    try:
        manifest = files.read_manifest(existing)
    except ValueError:
        manifest = {}
    theirs = (manifest.get("run") or {}).get("id")
    mine = (run or {}).get("id")
    if mine is not None and mine == theirs:
        return None
    whose = f"of run {theirs}" if theirs is not None else "saved without a run id"
    return (f"it already holds a checkpoint (step {manifest.get('step', '?')}, {whose}), and a "
            f"checkpoint belongs to the run that saved it: choose another path, delete that "
            f"one, or pass run={{'id': ...}} with the id of the run it belongs to (the same id "
            f"on every save of a run) to replace it")


def _raise_if_any(group, problem: Optional[str], cls: type, headline: str) -> None:
    found = _agree(group, problem)
    if found:
        detail = "; ".join(f"rank {r}: {p}" for r, p in found)
        raise cls(f"{headline}: {detail}")


# ---------------------------------------------------------------------------------------------
# load


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names (no collective).

    ``path`` is either a checkpoint directory, or a root of ``step_<N>`` checkpoints, which
    resolves to the latest complete one (``latest_checkpoint``). A checkpoint whose replacement
    was interrupted is read from where it survived ([Note: atomic checkpoint commit]).
    """
    path = Path(path)
    if files.is_complete(path):
        return path
    old = files.old_dir_for(path)
    if not path.exists() and old.is_dir() and files.is_complete(old):
        return old
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if path.is_dir() and (any(path.iterdir()) or files.tmp_dir_for(path).exists()):
        raise CheckpointNotFoundError(
            f"{path} is not a complete zbuf checkpoint: it has no {files.MANIFEST_NAME} (the save "
            f"that wrote it never finished, or it is not a zbuf checkpoint) and no complete "
            f"step_<N> checkpoints inside. Load an earlier checkpoint (zbuf.list_checkpoints(root))"
        )
    raise CheckpointNotFoundError(
        f"no zbuf checkpoint at {path}: pass a directory written by zbuf.save_checkpoint, or a "
        f"root directory holding step_<N> checkpoints (zbuf.checkpoint_path(root, step))"
    )


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Step, world size and creation time of a checkpoint, from its manifest (no collective)."""
    resolved = resolve_checkpoint(path)
    try:
        manifest = files.read_manifest(resolved)
    except ValueError as e:
        raise CheckpointCorruptError(f"cannot read the checkpoint at {resolved}: {e}",
                                     problem=str(e)) from None
    return _info(resolved, manifest, None)


def _info(path: Path, manifest: dict, extra: Any) -> CheckpointInfo:
    return CheckpointInfo(
        path=path,
        step=int(manifest["step"]),
        world_size=int(manifest["world_size"]),
        extra=extra,
        created_unix=float(manifest.get("created_unix", 0.0)),
        has_optimizer=manifest.get("optimizer") is not None,
        run=manifest.get("run"),
    )


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place; returns what was loaded.

    Collective over the model's sharding group; every rank passes the same ``path``. The world
    size may differ from the one that saved. Nothing is changed unless every check passes
    ([Note: validate, then load]).

    Args:
        path: a checkpoint directory, or a root of ``step_<N>`` checkpoints (the latest complete
            one is loaded; see ``resolve_checkpoint``).
        model: the module ``zbuf.shard`` returned, built like the one that was saved.
        optimizer: an optimizer built like the saved one (same class, same param groups in the
            same order), or None to load only the model (e.g. for evaluation).
        verify: check every file's CRC-32 before loading (reads the checkpoint once more, split
            across ranks). Sizes are always checked.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise LayoutError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    inv = layout.inventory(model)
    group = inv.group
    rank, world = dist.get_rank(group), group.size()

    with record_function("zbuf::checkpoint::validate"):
        # rank 0 resolves and reads the manifest, so every rank validates against the same one
        found = None
        if rank == 0:
            try:
                resolved = resolve_checkpoint(path)
                found = (str(resolved), files.read_manifest(resolved), None)
            except CheckpointError as e:
                found = (None, None, ("notfound", str(e)))
            except ValueError as e:
                found = (None, None, ("corrupt", f"the checkpoint at {resolved} is damaged: {e}"))
            except Exception as e:  # noqa: BLE001 - every rank must learn it, not wait for rank 0
                found = (None, None, ("corrupt", f"cannot read the checkpoint at {path}: {type(e).__name__}: {e}"))
        resolved_str, manifest, failure = _from_rank0(group, found)
        if failure is not None:
            kind, message = failure
            raise (CheckpointNotFoundError if kind == "notfound" else CheckpointCorruptError)(message)
        resolved = Path(resolved_str)

        problems = _check_manifest_version(manifest)
        if not problems:
            try:
                problems = files.check_files(resolved, manifest["files"], rank, world, checksums=verify)
            except Exception as e:  # noqa: BLE001 - shared with every rank below
                problems = [f"reading its files failed ({type(e).__name__}: {e})"]
        metadata = None
        if not problems:
            try:
                metadata = FileSystemReader(resolved).read_metadata()
            except Exception as e:  # noqa: BLE001 - any failure to read DCP metadata is damage
                problems = [f"DCP's .metadata cannot be read ({type(e).__name__}: {e})"]
        found = _agree(group, "; ".join(problems) if problems else None)
        if found:
            detail = "; ".join(p for _, p in found[:1]) if len({p for _, p in found}) == 1 else "; ".join(
                f"rank {r}: {p}" for r, p in found)
            raise CheckpointCorruptError(
                f"the checkpoint at {resolved} is damaged, nothing was loaded: {detail}. Load an "
                f"earlier checkpoint (zbuf.list_checkpoints(root) lists them) or re-save this one",
                problem=detail)

        mismatches = _check_model(manifest, inv, metadata)
        if optimizer is not None:
            mismatches += _check_optimizer(manifest, inv, optimizer)
        if mismatches:
            raise CheckpointMismatchError(
                f"the checkpoint at {resolved} does not belong to this model/optimizer, nothing was "
                f"loaded: {'; '.join(mismatches)}. Build the model and optimizer with the "
                f"configuration the checkpoint was saved with (saved at step {manifest['step']} by "
                f"{manifest['world_size']} ranks), or pass optimizer=None to load only the model"
            )

    with record_function("zbuf::checkpoint::read"):
        state, optim_dest = _load_state(manifest, inv, optimizer)
        try:
            dcp.load(state, storage_reader=FileSystemReader(resolved), process_group=group)
        except Exception as e:
            raise CheckpointError(
                f"reading {resolved} failed after validation ({type(e).__name__}: {e}); the model "
                f"may be partly loaded: load a checkpoint again before training"
            ) from e

    with record_function("zbuf::checkpoint::apply"):
        with torch.no_grad():
            for e in inv.params.values():
                e.shard.detach()[e.local_numel:].zero_()  # padding, see [Note: shard layout] in param.py
        if optimizer is not None:
            optimizer.load_state_dict(layout.optimizer_state_dict(state, optim_dest))
        extra = layout.deserialise(state[layout.EXTRA_KEY]) if manifest.get("has_extra") else None
    return _info(resolved, manifest, extra)


def _check_manifest_version(manifest: dict) -> list[str]:
    version = manifest.get("version")
    if version != FORMAT_VERSION:
        return [f"its format version is {version!r}; this zbuf reads version {FORMAT_VERSION}"]
    for key in ("step", "world_size", "model", "files"):
        if key not in manifest:
            return [f"its manifest has no '{key}'"]
    return []


def _compare_entries(kind: str, saved: dict, current: dict) -> list[str]:
    """Problems between a checkpoint's ``{fqn: {"shape": [...]}}`` and a model's ``{fqn: shape}``."""
    out = []
    missing = [f for f in current if f not in saved]
    unexpected = [f for f in saved if f not in current]
    if missing:
        out.append(f"{kind}s missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        out.append(f"unexpected {kind}s in the checkpoint (not in this model): {_listing(unexpected)}")
    shapes = [
        f"{f}: checkpoint {tuple(saved[f]['shape'])}, model {shape}"
        for f, shape in current.items()
        if f in saved and tuple(saved[f]["shape"]) != shape
    ]
    if shapes:
        out.append(f"{kind} shape mismatch: {_listing(shapes)}")
    return out


def _check_model(manifest: dict, inv: layout.ModelInventory, metadata) -> list[str]:
    out = _compare_entries("parameter", manifest["model"]["params"],
                           {f: e.spec.shape for f, e in inv.params.items()})
    out += _compare_entries("buffer", manifest["model"].get("buffers", {}),
                            {f: tuple(b.shape) for f, b in inv.buffers.items()})
    if out:
        return out
    # The manifest agrees with the model; DCP's own metadata must agree with the manifest.
    md = metadata.state_dict_metadata
    bad = []
    for f, e in inv.params.items():
        m = md.get(layout.model_key(f))
        if m is None or tuple(getattr(m, "size", ())) != (e.spec.numel,):
            bad.append(f)
    if bad:
        out.append(f"DCP metadata disagrees with the manifest for {_listing(bad)} (a damaged or "
                   f"hand-edited checkpoint)")
    return out


def _check_optimizer(manifest: dict, inv: layout.ModelInventory, optimizer) -> list[str]:
    saved = manifest.get("optimizer")
    if saved is None:
        return ["the checkpoint has no optimizer state (saved with optimizer=None)"]
    out = []
    cls = type(optimizer).__qualname__
    if saved["class"] != cls:
        out.append(f"optimizer class: checkpoint {saved['class']}, given {cls}")
    current = layout.optimizer_param_fqns(optimizer, inv)
    if len(current) != len(saved["param_groups"]):
        out.append(f"optimizer param groups: checkpoint {len(saved['param_groups'])}, given {len(current)}")
    else:
        for gi, (a, b) in enumerate(zip(saved["param_groups"], current)):
            if a != b:
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out.append(
                    f"optimizer param group {gi} differs at position {first}: checkpoint "
                    f"{a[first] if first < len(a) else '<end>'}, given {b[first] if first < len(b) else '<end>'}"
                )
                break
    return out


def _load_state(manifest: dict, inv: layout.ModelInventory, optimizer) -> tuple[dict, dict]:
    """The DCP state dict to read into: views of the live parameters and buffers, fresh tensors
    for optimizer state (its state may not exist yet; the host memory an offload keeps it in,
    [Note: loading streamed state] in zbuf/optimizer_step_offload.py), placeholders for
    serialised values."""
    mesh = layout.mesh_for(inv.group, inv.device)
    state: dict[str, Any] = {}
    for fqn, e in inv.params.items():
        state[layout.model_key(fqn)] = layout.flat_dtensor(layout.param_view(e), e.spec.numel, mesh)
    for fqn, buf in inv.buffers.items():
        state[layout.buffer_key(fqn)] = buf.detach()
    optim_dest: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        offload = streamed_state_of(optimizer)
        optim_dest = layout.optimizer_destinations(
            manifest["optimizer"], inv, mesh, state,
            home=None if offload is None else offload.load_home)
    if manifest.get("has_extra"):
        state[layout.EXTRA_KEY] = b""
    return state, optim_dest
