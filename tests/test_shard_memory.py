"""Eager memory: about one layer's gathered weights at a time, every pool block back after a step.

Counted with the gather-buffer pool's own accounting (a dedicated pool per model): its high-water
charged bytes must stay within two layers' gathered bytes for a model of LAYERS equal layers
(without the re-gather of [Note: eager re-gather] every layer's weights stay alive until
backward: LAYERS layers). 50 steps must leave no lease checked out and allocate nothing after the
first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_utils import run_distributed

LAYERS, DIM, HIDDEN, STEPS = 6, 24, 56, 50


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.ckpt = ckpt

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return x


def _memory_worker(rank, world):
    from zbuf.pool import GatherBufferPool
    from zbuf.shard import op_counts, root_of, shard

    out = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        pool = GatherBufferPool("cpu")
        model = shard(Stack(ckpt), pool=pool)
        layer_bytes = sum(
            spec.gathered_nbytes for spec in model._zbuf_root.specs.values()
            if spec.fqn.startswith("layers.0.")
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
        allocations_after_first = None
        gathers_per_step = []
        for step in range(STEPS):
            before = op_counts(model)["all_gather"]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gathers_per_step.append(op_counts(model)["all_gather"] - before)
            stats = pool.stats()
            assert stats.checked_out == 0, f"step {step}: {stats.checked_out} leases not returned"
            assert root_of(model).regather.live_tracked() == 0
            if step == 0:
                allocations_after_first = stats.allocations
        stats = pool.stats()
        assert stats.allocations == allocations_after_first, "the pool kept allocating after step 1"
        out[ckpt] = {
            "high_water": stats.high_water_bytes,
            "layer_bytes": layer_bytes,
            "model_bytes": model._zbuf_root.gathered_nbytes,
            "gathers_per_step": gathers_per_step[-1],
            "hits": stats.hits,
        }
    return out


def test_eager_memory_one_layer_and_no_leak():
    results = run_distributed(_memory_worker, 2)
    for per_rank in results:
        for ckpt, r in per_rank.items():
            assert r["model_bytes"] == LAYERS * r["layer_bytes"]
            # about one layer: the forward holds one layer's weights (plus the next being gathered
            # by its first use), backward re-gathers one saved weight per node
            assert r["high_water"] <= 2 * r["layer_bytes"], (ckpt, r)
            # forward gathers every weight once; backward re-gathers the saved ones
            # (up.weight, down.weight per layer: linear saves the weight, not the bias; the first
            # layer's input needs no gradient, so its up.weight is not saved); checkpointing
            # re-runs every layer's forward instead: all four again
            expected = LAYERS * 4 + (LAYERS * 4 if ckpt else LAYERS * 2 - 1)
            assert r["gathers_per_step"] == expected, (ckpt, r)
            assert r["hits"] > 0
