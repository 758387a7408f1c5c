"""The zbuf compile backend on CUDA over NCCL with the cudarc pool (1 or 2 GPUs).

Inductor compiles the built-in decoder; the schedule's start/wait ops run NCCL all-gathers
asynchronously (one coalesced collective per block). Checks: fp32 parity with eager zbuf and with
stock Inductor on the same sharded model, bf16 gathers, the generated code keeps the planned
order, every started gather is waited for, and after the first step no gather allocates.
"""

from __future__ import annotations

import copy
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.cuda

STEPS = 4


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _train(run, model, batches, rank, world):
    import torch.distributed as dist

    from zbuf.models import loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens, targets in batches:
        value = loss(run, tokens.chunk(world)[rank], targets.chunk(world)[rank])
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = value.detach().float()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _gpu_worker(rank, world):
    from torch._inductor.utils import run_and_get_code

    from zbuf.compile import schedule_report
    from zbuf.models import build_model, loss, resolve_config
    from zbuf.shard import shard
    from zbuf.state_dict import full_state_dict

    import zbuf.runtime as zruntime

    # [Note: poisoned releases]: a kernel that reads a gathered weight after its release sees
    # NaN here instead of whatever the next gather wrote into the block.
    zruntime.POISON_RELEASES = True
    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = resolve_config("tiny").replace(num_layers=2, vocab_size=128)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 128, (2 * world, 32), generator=g).to(dev),
                torch.randint(0, 128, (2 * world, 32), generator=g).to(dev)) for _ in range(STEPS)]
    out = {}
    for dtype in (None, torch.bfloat16):
        torch._dynamo.reset()
        torch.manual_seed(0)
        init = build_model(cfg).to(dev)
        eager = shard(copy.deepcopy(init), param_dtype=dtype)
        eager_losses = _train(eager, eager, batches, rank, world)
        stock = shard(copy.deepcopy(init), param_dtype=dtype)
        stock_losses = _train(torch.compile(stock, fullgraph=True), stock, batches, rank, world)
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init), param_dtype=dtype)
        pool = model._zbuf_root.pool
        cm = torch.compile(model, backend="zbuf", fullgraph=True,
                           options={"budget_bytes": 4 << 20, "persist": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, misses = [], []
        for i, (tokens, targets) in enumerate(batches):
            before = pool.stats()

            def step():
                value = loss(cm, tokens.chunk(world)[rank], targets.chunk(world)[rank])
                value.backward()
                return value

            if i == 0:
                value, codes = run_and_get_code(step)
            else:
                value = step()
            torch.cuda.synchronize()
            misses.append(pool.stats().misses - before.misses)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = value.detach().float()
            torch.distributed.all_reduce(value)
            losses.append(value.item() / world)
        recs = schedule_report(model)
        assert [r.kind for r in recs] == ["forward", "backward"]
        for code, rec in zip(codes, recs):
            emitted = re.findall(r"torch\.ops\.zbuf\.(\w+)\.default\(", code)
            assert emitted == list(rec.op_order), (rec.kind, emitted, list(rec.op_order))
            # Every reduce-scatter is the token-ordered form ([Note: schedule token]).
            assert "reduce_scatter" not in emitted, emitted
            # Every start is waited for in its graph ([Note: work in flight lives on the token]).
            for kind in ("all_gather", "reduce_scatter"):
                assert emitted.count(f"{kind}_start") == emitted.count(f"{kind}_wait"), emitted
        assert misses[1:] == [0] * (STEPS - 1), misses
        assert pool.stats().checked_out == 0
        tol = 1e-5 if dtype is None else 2e-2
        torch.testing.assert_close(losses, stock_losses, rtol=tol, atol=0)
        torch.testing.assert_close(losses, eager_losses, rtol=tol, atol=0)
        full, ref = full_state_dict(model), full_state_dict(stock)
        worst = max(_rel(full[k].to(dev), ref[k].to(dev)) for k in ref)
        if dtype is None:
            # [Note: fp32 parity bound on CUDA]
            # zbuf's compiled step is not the same kernel sequence as stock Inductor's on the same
            # sharded model: gathers split into start / wait, releases that take their readers'
            # outputs, a 4 MiB budget that re-gathers in backward and no peak-memory reordering
            # all change what Inductor fuses, so reductions run in another order, and four AdamW
            # steps amplify that for weights whose gradients are near zero (Adam divides by
            # sqrt(v)). Measured on one H200 (world 1, so no collective is involved): zbuf vs
            # stock 1.32e-5 worst relative weight difference; DDP compiled with Inductor vs stock
            # 2e-8 (the same graph, the same kernels: not a measure of reduction-order noise);
            # eager zbuf vs stock is the spread of two correct fp32 implementations with
            # different kernels. The bound is that spread, measured in the same run: zbuf may
            # differ from stock Inductor by at most twice what eager differs from it, and never by
            # more than 1e-5 when eager agrees closer.
            eager_full = full_state_dict(eager)
            spread = max(_rel(eager_full[k].to(dev), ref[k].to(dev)) for k in ref)
            bound = max(1e-5, 2 * spread)
        else:
            spread, bound = None, 1e-2
        assert worst <= bound, (worst, spread)
        out[str(dtype)] = {"losses": losses, "records": [json_safe(r) for r in recs], "vs_stock": worst,
                           "eager_vs_stock": spread}
    return out


def json_safe(rec):
    return {k: getattr(rec, k) for k in ("kind", "gathers", "collectives", "coalesced_groups", "prefetched",
                                        "regathers", "peak_live_gathered_bytes", "budget_bytes", "fingerprint")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zbuf_inductor_on_cuda():
    world = _world()
    results = run_distributed(_gpu_worker, world, backend="nccl", timeout=900)
    for key in results[0]:
        assert all(r[key]["losses"] == results[0][key]["losses"] for r in results)
        assert all(r[key]["records"] == results[0][key]["records"] for r in results)
    print(results[0])


def _checkpointed_first_step(rank, world):
    from zbuf.models import apply_activation_checkpointing, build_model, loss, resolve_config
    from zbuf.shard import shard
    from zbuf.train.compile_phases import PhaseClock

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    cfg = resolve_config("tiny").replace(num_layers=2, vocab_size=128)
    model = apply_activation_checkpointing(build_model(cfg).to(dev))
    model = shard(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cm = torch.compile(model, backend="zbuf", fullgraph=True, options={"persist": False})
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, 128, (2, 64), generator=g).to(dev) for _ in range(2))
    with PhaseClock() as clock:
        loss(cm, tokens, targets).backward()
        torch.cuda.synchronize()
    got = clock.result(0.0)
    return {"caches": got.caches, "reasons": got.cache_bypass_reasons}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_attention_on_cuda_is_cacheable(tmp_path):
    """[Note: cacheable recompute of seeded ops]: bf16 attention recomputed under activation
    checkpointing on CUDA (a seeded op) leaves the step's graphs cacheable, so a relaunch can
    start warm."""
    got = run_distributed(_checkpointed_first_step, 1, backend="nccl", timeout=600,
                          env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})[0]
    assert got["caches"]["fxgraph_bypass"] == 0 and got["reasons"] == [], got
    assert got["caches"]["fxgraph_miss"] >= 2, got
