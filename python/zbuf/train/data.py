"""Synthetic, learnable token tasks: no dataset download, no tokenizer, identical on every engine.

The global batch of step ``s`` is a pure function of ``(task, seed, s)``; rank ``r`` takes rows
``[r * micro_batch, (r + 1) * micro_batch)``. So a run on 1 rank and on 4 ranks, under DDP, FSDP2
or zbuf, sees the same tokens, and per-step losses are comparable across engines.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import Task

__all__ = ["IGNORE_INDEX", "Task", "Batch", "global_batch", "rank_batch"]

IGNORE_INDEX = -100


class Batch(NamedTuple):
    tokens: torch.Tensor
    """[micro_batch, seq_len] int64 inputs."""
    targets: torch.Tensor
    """[micro_batch, seq_len] int64 next-token targets, ``IGNORE_INDEX`` where not scored."""


def global_batch(task: Task, seed: int, step: int, batch: int, seq_len: int,
                 vocab: int) -> Batch:
    """All ranks' rows for one step, generated on the CPU from ``(seed, step)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if task is Task.STRIDE:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 9, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    half = seq_len // 2
    # Small alphabet (16 symbols) so the unconditioned floor, ln 16, is far below ln(vocab).
    first = torch.randint(0, min(vocab, 16), (batch, half), generator=g)
    second = first if task is Task.COPY else first.flip(1)
    seq = torch.cat([first, second, first[:, : seq_len - 2 * half]], dim=1)
    targets = torch.full_like(seq, IGNORE_INDEX)
    # Position i predicts token i + 1; only the determined second half is scored.
    targets[:, half - 1: 2 * half - 1] = seq[:, half: 2 * half]
    return Batch(seq, targets)


def rank_batch(task: Task, seed: int, step: int, micro_batch: int, world: int, rank: int,
               seq_len: int, vocab: int, device: torch.device) -> Batch:
    """This rank's slice of the global batch, moved to ``device``."""
    full = global_batch(task, seed, step, micro_batch * world, seq_len, vocab)
    rows = slice(rank * micro_batch, (rank + 1) * micro_batch)
    return Batch(full.tokens[rows].to(device, non_blocking=True),
                 full.targets[rows].to(device, non_blocking=True))
