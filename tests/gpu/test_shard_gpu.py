"""``zbuf.shard`` on CUDA over NCCL with the cudarc pool (1 or 2 GPUs; the lead runs these).

fp32 parity against the unsharded reference (eager and Inductor), bf16 gathers with fp32
reduction, and the eager memory bound and leak check measured by the CUDA pool.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.cuda


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _gpu_worker(rank, world):
    import torch.nn.functional as F

    from test_shard_memory import DIM, LAYERS, Stack
    from test_shard_parity import ParityNet, assert_state_matches, make_batches, train
    from zbuf.pool import GatherBufferPool
    from zbuf.shard import op_counts, shard
    from zbuf.state_dict import full_state_dict

    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}

    # fp32 parity, eager and Inductor
    torch.manual_seed(0)
    init = ParityNet().to(dev)
    batches = [(t.to(dev), y.to(dev)) for t, y in make_batches()]
    ref = copy.deepcopy(init)
    ref_losses, _ = train(ref, batches, rank, world, sharded=False)
    for mode in ("eager", "inductor"):
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init))
        assert all(p.device == dev for p in model.parameters())
        run = model if mode == "eager" else torch.compile(model, fullgraph=True)
        losses, _ = train(run, batches, rank, world, sharded=True)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert_state_matches({k: v.to(dev) for k, v in full_state_dict(model).items()}, ref, mode,
                             per_tensor=True)
        out[mode] = losses

    # bf16 gathers, fp32 reduce-scatter into fp32 shards
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, device=dev)
    model = shard(copy.deepcopy(lin), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    before = op_counts(model)["all_gather_bytes"]
    w = model.weight
    assert w.dtype == torch.bfloat16 and w.is_cuda
    assert op_counts(model)["all_gather_bytes"] - before == 64 * 48 * 2
    del w
    x = torch.randn(8, 64, device=dev, dtype=torch.bfloat16)
    F.mse_loss(model(x).float(), torch.zeros(8, 48, device=dev)).backward()
    g = model._parameters["weight"].grad
    assert g.dtype == torch.float32 and g.is_cuda and torch.isfinite(g).all()

    # eager memory: one layer's gathered weights, no leak over 20 steps
    torch.manual_seed(0)
    pool = GatherBufferPool(dev)
    model = shard(Stack(False).to(dev), pool=pool)
    layer_bytes = sum(s.gathered_nbytes for s in model._zbuf_root.specs.values() if s.fqn.startswith("layers.0."))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, DIM, device=dev)
    for _ in range(20):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        assert pool.stats().checked_out == 0
    stats = pool.stats()
    assert stats.high_water_bytes <= 2 * layer_bytes, (stats, layer_bytes)
    assert LAYERS * layer_bytes == model._zbuf_root.gathered_nbytes
    return out


def test_shard_on_cuda_nccl():
    world = _world()
    results = run_distributed(_gpu_worker, world, backend="nccl", timeout=600)
    assert all(r == results[0] for r in results)
