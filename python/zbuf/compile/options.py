"""Typed, validated options of the zbuf compile backend.

Three sections, one flat record: what a user sets (``UserOptions``), the cost model's constants
(``CostModel``) and what ``zbuf.compile`` fills in (``FilledIn``). Which modes combine is the
table's ([Note: one table of modes] in modes.py), read once in ``CompileOptions.__post_init__``.

Every field is rank-invariant by construction (plain numbers and flags that each rank passes
identically), because every input to the scheduler must be the same on all ranks: see
[Note: rank-invariant schedule] in schedule.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from .modes import Modes, refusal

__all__ = ["CompileOptions", "UserOptions", "CostModel", "FilledIn", "RECOMPUTE_MODES",
           "STRUCTURES"]

Inner = Literal["inductor", "aot_eager"]
Recompute = Literal["checkpointed", "auto", "none"]
RECOMPUTE_MODES = ("checkpointed", "auto", "none")
Structure = Literal["graph", "blocks"]
STRUCTURES = ("graph", "blocks")


@dataclass(frozen=True)
class UserOptions:
    """What a user sets: the modes and knobs of ``zbuf.compile`` and of ``torch.compile(m,
    backend="zbuf", options={...})``."""

    budget_bytes: int | None = None
    """Cap on live gathered bytes at every node of every graph. ``None``: derived from the
    rank-agreed free memory (see budget.py). Raised to the smallest feasible value (the bytes a
    single node needs at once) when set lower, and reported as such."""

    optimizer_in_backward: bool = False
    """Each backward graph hands every gradient shard it makes to ``zbuf::step_in_backward``
    and returns none ([Note: optimizer in backward] in zbuf/optimizer_in_backward.py): set by
    ``zbuf.compile(..., optimizer_in_backward=True)``, which attaches the optimizer the op
    steps."""

    prefetch: bool = True
    """Start gathers early so that communication overlaps compute, within the budget."""

    persist: bool | None = None
    """Keep some gathered weights resident from forward to backward when the budget leaves room
    (ranked by communication time saved per byte) instead of re-gathering them in backward
    ([Note: selective persistence] in persist.py). ``None`` (default): where it saves something,
    so never at world 1, where a gather moves nothing over a link. ``True``: within the budget
    whatever the world size. ``False``: never. The plans ``zbuf.compile`` measures and re-plans
    keep them at run time instead of in the graph ([Note: weights kept at run time] in
    zbuf/kept_weights.py): the re-planner applies this option to the keep-set, and compiles its
    graphs with ``persist=False``."""

    persist_fraction: float = 0.5
    """Share of the budget that selective persistence may use; the rest stays for prefetch."""

    coalesce: bool = True
    """Issue one collective for adjacent small gathers of the same block."""

    coalesce_max_bytes: int = 64 << 20
    """Largest total gathered bytes of one coalesced collective."""

    coalesce_min_bytes: int = 32 << 20
    """Gathers at or above this size are never coalesced (they already saturate the link)."""

    structure: Structure | None = None
    """How ``zbuf.compile`` has Dynamo trace the model ([Note: one path] in compiled_model.py).
    ``None`` (default): ``"blocks"`` for a sharded model with a repeated stack of blocks, unless
    an option only the whole graph takes is set (``optimizer_in_backward``,
    ``activation_budget_bytes``), else ``"graph"``. ``"blocks"``: one
    frame per repeated block, shared by identical blocks (compiled once whatever their number, as
    FSDP2 and torchtitan compile a block), the cross-block schedule carried by zbuf's runtime (one
    block ahead, released after the block, re-gathered for backward) and the rest of the model
    eager ([Note: one Dynamo frame per block] in block_frames.py); its ``recompute="auto"`` gives
    each block call a level in the measured room, one compiled frame per level in use ([Note:
    block levels] in block_replan.py). ``"graph"``: the whole model as one frame, which the
    planner sees whole (budget per weight, prefetch, persistence, budgeted recompute, the
    collective-order fingerprint), every block traced and compiled. A plain
    ``torch.compile(m, backend="zbuf")`` always compiles what Dynamo hands it."""

    recompute: Recompute = "checkpointed"
    """What backward recomputes of the model's checkpointed regions ([Note: recompute modes] in
    recompute.py): ``"checkpointed"`` as the user checkpointed them; ``"auto"`` zbuf keeps each
    region's activations, its matmul and attention outputs only, or nothing, within the activation
    budget, recomputing what is cheapest per byte; ``"none"`` keeps every region's activations."""

    activation_budget_bytes: int | None = None
    """``recompute="auto"``: cap on the activation peak of the forward and backward graphs.
    ``None``: the rank-agreed graph memory less what the gathers need ([Note: budgeted
    recompute]). Raised to the peak with every region recomputed when set lower, and reported."""

    inner: Inner = "inductor"
    """What compiles the rewritten graphs: Inductor, or ``aot_eager`` (runs the FX graphs as they
    are; fast to compile, for debugging and CPU tests)."""

    check_fingerprint: bool = True
    """Check on every run of every compiled graph that all ranks run a graph with the same input
    shapes and collective order; a mismatch raises ``ScheduleMismatchError`` on every rank. One
    8-byte all-gather per graph run ([Note: collective order check] in fingerprint.py); off, a
    mismatch hangs."""

    unmeasured_fraction: float = 0.1
    """Part of the free memory agreed at compile time that plans made before any measurement
    leave for what nothing has measured yet (the allocator's fragmentation, workspaces, NCCL's
    buffers): step 0's, and every plan of a plain ``torch.compile(m, backend="zbuf")``. Plans
    made from the measured step do not read it ([Note: measured memory is not margined twice]
    in budget.py)."""

    def _check_user(self, need) -> None:
        need(self.structure is None or self.structure in STRUCTURES,
             f"structure={self.structure!r} must be one of {', '.join(map(repr, STRUCTURES))} "
             f"or None (zbuf.compile picks)")
        need(self.recompute in RECOMPUTE_MODES,
             f"recompute={self.recompute!r} must be one of {', '.join(map(repr, RECOMPUTE_MODES))}")
        if self.activation_budget_bytes is not None:
            need(isinstance(self.activation_budget_bytes, int)
                 and not isinstance(self.activation_budget_bytes, bool)
                 and self.activation_budget_bytes > 0,
                 f"activation_budget_bytes={self.activation_budget_bytes!r} must be a positive int "
                 "(bytes) or None to derive it from the rank-agreed free memory")
        if self.budget_bytes is not None:
            need(
                isinstance(self.budget_bytes, int) and not isinstance(self.budget_bytes, bool)
                and self.budget_bytes > 0,
                f"budget_bytes={self.budget_bytes!r} must be a positive int (bytes) or None "
                "to derive it from the rank-agreed free memory",
            )
        need(self.persist in (None, True, False), f"persist={self.persist!r} must be a bool or None")
        for name in ("prefetch", "coalesce", "check_fingerprint", "optimizer_in_backward"):
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be a bool")
        need(0.0 <= self.persist_fraction <= 1.0,
             f"persist_fraction={self.persist_fraction!r} must lie in [0, 1]")
        need(0.0 <= self.unmeasured_fraction < 1.0,
             f"unmeasured_fraction={self.unmeasured_fraction!r} must lie in [0, 1)")
        for name in ("coalesce_max_bytes", "coalesce_min_bytes"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, f"{name}={v!r} must be a non-negative int (bytes)")
        need(self.inner in ("inductor", "aot_eager"),
             f"inner={self.inner!r} must be 'inductor' or 'aot_eager'")


@dataclass(frozen=True)
class CostModel:
    """The cost model's constants: what the planners assume of the hardware (persistence ranks
    weights by communication time saved per byte, recompute regions by compute time per byte).
    The defaults are one GPU node's order of magnitude (100 GB/s a rank, 400 TFLOP/s, 3 TB/s); a
    user may tune them like any option."""

    link_bytes_per_second: float = 100e9
    """Per-rank all-gather bandwidth of the cost model (bytes received per second)."""

    collective_latency_seconds: float = 30e-6
    """Fixed cost of one collective in the cost model."""

    flops_per_second: float = 400e12
    """Matmul throughput of the cost model."""

    memory_bytes_per_second: float = 3e12
    """Memory bandwidth of the cost model (elementwise and data-movement nodes)."""

    host_link_bytes_per_second: Optional[float] = None
    """Host link (PCIe) bandwidth as the copy queue counts it: what offloading a block's
    activations costs ([Note: offloaded blocks] in block_offload.py). None (the default):
    measured each way on the device when the plan is first made ([Note: the measured host link]
    in zbuf/host_link.py; ``recompute_plan.queue_speed`` of the two); a PCIe 5
    x16 link moved 47.6 GB/s each way at once on an H200 (benches/results/offload14.md). Either
    way the plan models a copy at ``LINK_SHARE`` of it ([Note: the copy queue] in
    recompute_plan.py)."""

    replan_payback_steps: int = 100
    """The default's re-plan ([Note: offloaded under the step's own peak] in block_replan.py)
    takes a plan whose level needs a frame not yet compiled only if the recompute it saves a
    step, modelled, adds up within this many steps to what the first step took (its frame's
    compile and one run): [Note: a re-plan's compile pays for itself] in block_replan.py."""

    def _check_cost(self, need) -> None:
        need(isinstance(self.replan_payback_steps, int)
             and not isinstance(self.replan_payback_steps, bool) and self.replan_payback_steps > 0,
             f"replan_payback_steps={self.replan_payback_steps!r} must be a positive int (steps)")
        for name in ("link_bytes_per_second", "flops_per_second", "memory_bytes_per_second",
                     "host_link_bytes_per_second"):
            v = getattr(self, name)
            if v is None and name == "host_link_bytes_per_second":
                continue  # measured
            need(isinstance(v, (int, float)) and v > 0, f"{name}={v!r} must be a positive number")
        need(self.collective_latency_seconds >= 0,
             f"collective_latency_seconds={self.collective_latency_seconds!r} must be >= 0")


@dataclass(frozen=True)
class FilledIn:
    """What ``zbuf.compile`` fills in for the backend from the model, the optimizer and the
    rank-agreed memory (a plain ``torch.compile(m, backend="zbuf")`` leaves them unset); the
    re-planner fills them in again for the plans it makes."""

    free_memory_bytes: int | None = None
    """The rank-minimum free device memory that an unset ``budget_bytes`` derives from (see
    budget.py); must be the same on every rank. ``zbuf.compile`` fills it in with one all-reduce
    over the model's sharding group. ``None``: the device's total memory stands in."""

    gradient_bytes: int = 0
    """Bytes of the gradients the backward graphs make, not yet allocated when
    ``free_memory_bytes`` was agreed: each backward graph reserves those it does not make itself,
    the forward graphs none ([Note: gradients live in backward] in budget.py). ``zbuf.compile``
    fills it in; the same on every rank (the shards are)."""

    measured_room_bytes: int | None = None
    """What each graph's activations and gathered weights may share, as the measured step's
    ledger says (``Ledger.room_bytes`` in zbuf/memory/ledger.py): the re-planner fills it in for
    the plans it makes with ``recompute="auto"``, and budget.py uses it as it is ([Note: measured
    memory is not margined twice] in budget.py). ``None``: no measurement yet; the plans derive
    their memory from ``free_memory_bytes``."""

    measuring: bool = False
    """This plan runs the measured step ([Note: measure first, then spend] in
    zbuf/memory/step.py), so it is no hungrier than FSDP2's: no persistence, ``recompute="auto"``
    keeps no activations beyond the model's checkpointing, and each graph gathers at most what
    one node reads plus about one block ahead (``budget.gather_reserve``). ``zbuf.compile`` sets
    it for the first plan of a sharded model; the plans made from the measurement clear it."""

    def _check_filled(self, need) -> None:
        if self.free_memory_bytes is not None:
            need(
                isinstance(self.free_memory_bytes, int) and not isinstance(self.free_memory_bytes, bool)
                and self.free_memory_bytes >= 0,
                f"free_memory_bytes={self.free_memory_bytes!r} must be a non-negative int (bytes) "
                "or None",
            )
        need(isinstance(self.gradient_bytes, int) and not isinstance(self.gradient_bytes, bool)
             and self.gradient_bytes >= 0,
             f"gradient_bytes={self.gradient_bytes!r} must be a non-negative int (bytes)")
        if self.measured_room_bytes is not None:
            need(isinstance(self.measured_room_bytes, int)
                 and not isinstance(self.measured_room_bytes, bool)
                 and self.measured_room_bytes >= 0,
                 f"measured_room_bytes={self.measured_room_bytes!r} must be a non-negative int "
                 "(bytes) or None")
        need(isinstance(self.measuring, bool), f"measuring={self.measuring!r} must be a bool")


@dataclass(frozen=True)
class CompileOptions(FilledIn, CostModel, UserOptions):
    """Options of ``torch.compile(m, backend="zbuf", options={...})`` and ``zbuf.compile``:
    what a user sets (``UserOptions``), the cost model (``CostModel``) and what zbuf fills in
    (``FilledIn``), as one flat, validated record (the backend gets it as ``options=``, and its
    digest keys the passes' cache)."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"zbuf compile option {msg}")

        self._check_user(need)
        self._check_cost(need)
        self._check_filled(need)
        refused = refusal(self.modes)  # [Note: one table of modes] in modes.py
        need(refused is None, refused)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "CompileOptions":
        """Build from ``torch.compile(..., options=...)``; unknown keys are an error."""
        if options is None:
            return cls()
        if isinstance(options, CompileOptions):
            return options
        unknown = cls.unknown(options)
        if unknown:
            raise ValueError(f"unknown zbuf compile option(s) {unknown}; valid options: "
                             f"{sorted(f.name for f in dataclasses.fields(cls))}")
        return cls(**dict(options))

    @classmethod
    def unknown(cls, names) -> list[str]:
        """The ``names`` that are no option, sorted."""
        return sorted(set(names) - {f.name for f in dataclasses.fields(cls)})

    @property
    def modes(self) -> Modes:
        """The modes these options ask for ([Note: one table of modes] in modes.py)."""
        coalesce = any(getattr(self, f.name) != f.default for f in dataclasses.fields(self)
                       if f.name.startswith("coalesce"))
        return Modes(structure=self.structure, recompute=self.recompute,
                     optimizer_in_backward=self.optimizer_in_backward,
                     budget_bytes=self.budget_bytes is not None,
                     activation_budget_bytes=self.activation_budget_bytes is not None,
                     coalesce=coalesce)

    @property
    def graph_only(self) -> bool:
        """Whether these options ask for what only ``structure="graph"`` does: the table
        refuses them under ``"blocks"`` ([Note: one table of modes] in modes.py)."""
        return refusal(self.modes._replace(structure="blocks")) is not None

    def digest(self) -> str:
        """Stable hash of every field, part of the passes' cache uuid."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
