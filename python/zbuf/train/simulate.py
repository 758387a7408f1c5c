"""One process as rank 0 of N: ``--simulate-world N`` and ``zbuf.train.simulate.simulate_world``.

[Note: simulated ranks]
What one rank of an N-rank job holds and computes does not depend on the other ranks being
there; only the bytes the collectives move do. torch's fake process group (backend ``"fake"``,
``torch.testing._internal.distributed.fake_pg``) makes this process rank 0 of N: every
collective completes at once and moves nothing between ranks (its all-gathers copy the shard into
every rank's chunk, on the stream that issues them: zbuf's gather stream, FSDP2's all-gather
stream; [Note: the gather stream] in compile/block_gather.py), everything else is real. So under
``--simulate-world N``:

- rank 0's parameter shards, gradient shards and optimizer state are exactly a real rank 0's
  (the same sharding code with world size N), and so is its memory, less NCCL's own buffers;
- the sharded engines build the model on the meta device and materialise it shard by shard
  (``zbuf.shard(device=...)``, FSDP2's ``to_empty`` after ``fully_shard``): no rank ever holds the
  whole model, as none does in the real job. DDP holds the whole model, as a real DDP rank does;
- the step runs the same kernels as a real rank 0's, and nothing in zbuf branches on their
  values. But the values mean nothing. The fake reduce-scatter writes nothing into its output,
  so the first step's gradient shards hold whatever their fresh memory held: non-finite values
  on CPU (observed with the tiny preset: every step-0 gradient has some), zeros as a rule on the
  GPU. The optimizer turns them into NaN shards; a gathered buffer holds this rank's own chunk
  in every rank's place. So the losses
  depend on what the memory last held: qwen3-14b as rank 0 of 8 on the H200 ended at 12.96 for
  FSDP2 and at 20.2 or NaN for ``zbuf bench`` on different trees; the tiny preset on CPU at
  world 4 stays finite. The run goes on regardless: the training loop and zbuf have no path that
  depends on a value being finite, and on CPU denormals are flushed to zero in a simulated run
  (``torch.set_flush_denormal``) so that garbage bit patterns cannot slow the arithmetic down.
  Losses are recorded, labelled as not meaningful;
- step times are compute and memory only: no collective waits. What communication would add
  is estimated separately (``CommEstimate``), never folded into a step time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..shard import op_counts

__all__ = ["CommEstimate", "communication_estimate", "collective_bytes", "step_communication",
           "init_fake_group", "simulate_world", "SIMULATED_NOTE"]

SIMULATED_NOTE = ("simulated ranks: rank 0 of {world} over torch's fake process group; step "
                  "times are compute and memory only (communication excluded, estimated "
                  "separately), losses are not meaningful")
"""The one line that marks a simulated run in the summary, the report and the tables."""


def init_fake_group(world: int) -> None:
    """Make this process rank 0 of ``world`` over the fake backend (the default group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    torch.set_flush_denormal(True)  # garbage values must not cost time ([Note: simulated ranks])


@contextlib.contextmanager
def simulate_world(world: int) -> Iterator[None]:
    """``with simulate_world(8):`` this process is rank 0 of 8 until the block ends ([Note:
    simulated ranks]); build the model on the meta device and shard it inside (``zbuf.shard(
    model, device="cuda")``, or FSDP2's ``fully_shard`` then ``to_empty``)."""
    if world < 2:
        raise ValueError(f"simulate_world({world}): simulate 2 or more ranks")
    if dist.is_initialized():
        raise RuntimeError("simulate_world: a process group is already initialised; the "
                           "simulated one must be the default group")
    init_fake_group(world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class CommEstimate(NamedTuple):
    """What one rank's collectives would move in one step, and how long that takes at a link
    bandwidth: an estimate beside the measured step time, never part of it."""

    all_gather_bytes: int
    """Bytes of the full tensors the rank all-gathers per step (its output sizes)."""
    reduce_scatter_bytes: int
    """Bytes of the full gradients the rank reduce-scatters per step (its input sizes)."""
    all_reduce_bytes: int
    """Bytes the rank all-reduces per step (DDP's gradients)."""
    wire_bytes: int
    """Bytes each rank sends (and receives) per step over a ring: (N-1)/N of every all-gather
    and reduce-scatter, 2 (N-1)/N of every all-reduce."""
    link_gbps: float
    """The link bandwidth assumed, Gbit/s per direction (``--link-gbps``)."""
    seconds: float
    """``wire_bytes`` at ``link_gbps``: a lower bound on communication time (no latency, no
    overlap accounted for)."""
    source: str
    """Where the byte counts come from: counted by zbuf's collectives in a measured step, or
    derived from the engine's sharding (FSDP2, DDP)."""

    def to_json(self) -> dict:
        return self._asdict()


def communication_estimate(engine: str, world: int, link_gbps: float, *,
                           counted: Optional[tuple[int, int]], param_bytes: int,
                           block_param_bytes: int, grad_bytes: int) -> CommEstimate:
    """The per-step ``CommEstimate`` of one rank.

    ``counted``: (all-gather bytes, reduce-scatter bytes) zbuf's collectives issued in one
    measured step (the zbuf engines count them, ``zbuf.shard.op_counts``). Otherwise from the
    engine: FSDP2 gathers every parameter in forward and the blocks' again in backward (its
    root keeps its parameters from forward to backward) and reduce-scatters every gradient;
    DDP all-reduces every gradient. ``param_bytes``: all parameters in the gathered dtype;
    ``block_param_bytes``: the blocks' share of it; ``grad_bytes``: all gradients in the reduce
    dtype."""
    ag = rs = ar = 0
    if counted is not None:
        ag, rs = counted
        source = "counted: the all-gathers and reduce-scatters zbuf issued in a measured step"
    elif engine == "fsdp2":
        ag, rs = param_bytes + block_param_bytes, grad_bytes
        source = ("derived: FSDP2 gathers every parameter in forward and each block's again in "
                  "backward, and reduce-scatters every gradient")
    elif engine == "ddp":
        ar = grad_bytes
        source = "derived: DDP all-reduces every gradient"
    else:
        source = "none: no collective counted"
    ring = (world - 1) / world
    wire = int(ring * (ag + rs) + 2 * ring * ar)
    return CommEstimate(ag, rs, ar, wire, link_gbps, wire * 8 / (link_gbps * 1e9), source)


def collective_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all-gathered, reduce-scattered) bytes zbuf's collectives issued so far for ``model``'s
    parameters (0 for a model zbuf did not shard): their difference over steps is the
    ``counted`` of ``step_communication``."""
    counts = op_counts(model)
    return counts["all_gather_bytes"], counts["reduce_scatter_bytes"]


def step_communication(engine: str, world: int, link_gbps: float, model: torch.nn.Module,
                       counted: Optional[tuple[int, int]],
                       gathered_dtype: Optional[torch.dtype]) -> CommEstimate:
    """One rank's per-step ``CommEstimate``: zbuf's ``counted`` bytes of a measured step where
    given, else the engine's derived from ``model`` (its parameters gathered in
    ``gathered_dtype``, None: their own; its gradients reduced in fp32)."""
    if counted is not None:
        return communication_estimate(engine, world, link_gbps, counted=counted,
                                      param_bytes=0, block_param_bytes=0, grad_bytes=0)
    params, blocks, grads = model_bytes(model, gathered_dtype, torch.float32)
    return communication_estimate(engine, world, link_gbps, counted=None, param_bytes=params,
                                  block_param_bytes=blocks, grad_bytes=grads)


def model_bytes(model: torch.nn.Module, gathered_dtype: Optional[torch.dtype],
                reduce_dtype: Optional[torch.dtype]) -> tuple[int, int, int]:
    """(parameter bytes in ``gathered_dtype``, the blocks' (``model.layers``) share of them,
    gradient bytes in ``reduce_dtype``) of the unsharded model of an FSDP2 or DDP engine; None
    dtypes: each parameter's own. FSDP2's DTensor parameters report their full shapes."""
    def size(p: torch.Tensor, dtype: Optional[torch.dtype]) -> int:
        return p.numel() * (dtype or p.dtype).itemsize

    blocks = {id(p) for p in getattr(model, "layers", torch.nn.ModuleList()).parameters()}
    params = list(model.parameters())
    return (sum(size(p, gathered_dtype) for p in params),
            sum(size(p, gathered_dtype) for p in params if id(p) in blocks),
            sum(size(p, reduce_dtype) for p in params if p.requires_grad))
