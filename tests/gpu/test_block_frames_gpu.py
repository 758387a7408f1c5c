"""Block frames (``structure="blocks"``) on CUDA over NCCL with the cudarc pool (1 or 2 GPUs).

Inductor compiles one frame for the stack; the runtime's gathers run asynchronously on NCCL's
stream, one block ahead. Checks: losses as eager zbuf's (fp32 to Inductor's reduction-order
noise, bf16 gathers to bf16's), one frame graph, every gathered buffer back in the pool, and
nothing read after its release ([Note: poisoned releases]).

Written without a GPU run (the session that wrote it had no device time left): the first run on
the device is its first. The ``recompute="auto"`` case (levels and blocks kept for backward in
the measured room) was added, likewise unrun, on branch block-auto.
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

STEPS = 4


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _train(model, batches, rank, world):
    import torch.distributed as dist

    from zbuf.models import loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens, targets in batches:
        value = loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank])
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = value.detach().float()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _worker(rank, world):
    import zbuf.compile
    import zbuf.runtime as zruntime
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config
    from zbuf.shard import root_of, shard

    zruntime.POISON_RELEASES = True
    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = resolve_config("tiny").replace(num_layers=3, vocab_size=128)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 128, (2 * world, 32), generator=g).to(dev),
                torch.randint(0, 128, (2 * world, 32), generator=g).to(dev)) for _ in range(STEPS)]
    out = {}
    for dtype in (None, torch.bfloat16):
        for recompute in ("checkpointed", "none", "auto"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            init = build_model(cfg).to(dev)
            apply_activation_checkpointing(init, True)
            eager = shard(copy.deepcopy(init), param_dtype=dtype)
            eager_losses = _train(eager, batches, rank, world)
            model = shard(copy.deepcopy(init), param_dtype=dtype)
            zbuf.compile(model, structure="blocks", recompute=recompute, fullgraph=True)
            losses = _train(model, batches, rank, world)
            torch.cuda.synchronize()
            tol = 1e-4 if dtype is None else 2e-2
            torch.testing.assert_close(losses, eager_losses, rtol=tol, atol=0)
            # auto: the level-0 frame, then the frame of each level the measured room gives
            # ([Note: block levels] in compile/block_replan.py).
            assert block_frames_of(model).graphs_compiled <= (3 if recompute == "auto" else 1)
            assert root_of(model).pool.stats().checked_out == 0
            out[f"{dtype} {recompute}"] = losses
    return out


def test_block_frames_on_cuda():
    if _world() < 1:
        pytest.skip("needs a CUDA GPU")
    results = run_distributed(_worker, _world(), backend="nccl", timeout=900)
    assert all(r == results[0] for r in results)


def _gather_stream_worker(rank, world):
    import zbuf.compile
    import zbuf.runtime as zruntime
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config
    from zbuf.shard import root_of, shard

    zruntime.POISON_RELEASES = True
    dev = torch.device("cuda", rank)
    cfg = resolve_config("tiny").replace(num_layers=3, vocab_size=128)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 128, (2, 32), generator=g).to(dev),
                torch.randint(0, 128, (2, 32), generator=g).to(dev)) for _ in range(STEPS)]
    torch.manual_seed(0)
    init = build_model(cfg).to(dev)
    apply_activation_checkpointing(init, True)
    runs = {}
    for lag in (False, True):
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init), param_dtype=torch.bfloat16)
        zbuf.compile(model, structure="blocks", fullgraph=True)
        stream = root_of(model).pool.gather_stream
        if lag:  # each gather queued behind ~20 ms on its stream: a missing wait reads poison
            from zbuf.compile import block_gather
            launch = block_gather.launch_block_gather

            def lagging(weights):
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(20_000_000)
                return launch(weights)

            block_gather.launch_block_gather = lagging
            import zbuf.compile.block_prefetch as prefetch
            prefetch.launch_block_gather = lagging
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                losses = _train(model, batches, rank, world)
                torch.cuda.synchronize()
        finally:
            if lag:
                block_gather.launch_block_gather = launch
                prefetch.launch_block_gather = launch
        runs[lag] = losses
        assert root_of(model).pool.stats().checked_out == 0
        # The blocks' copy-ins run off the frames' stream. The parameters outside the blocks
        # (embedding, final norm, output projection) are gathered eagerly where they are used,
        # so some copy-ins stay on it: the first run found {'copy-in': {13, 7}, 'frame': {7}}.
        copy_ins, frame_streams = [], set()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                if "CopyFunctor" in e.name:
                    copy_ins.append(e.device_resource_id)
                elif e.name.startswith("triton"):
                    frame_streams.add(e.device_resource_id)
        beside = [s for s in copy_ins if s not in frame_streams]
        assert frame_streams and len(beside) >= cfg.num_layers * STEPS, (copy_ins, frame_streams)
    assert runs[True] == runs[False]
    return runs[False]


def test_gathers_fill_their_buffers_beside_the_compute_stream():
    """[Note: the gather stream]: the shards' copy-in runs on the pool's gather stream, not on
    the stream the frames compute on, and a gather stream that lags (each gather queued behind
    ~20 ms of sleep) changes no loss: the compute stream waits for every gather it reads, and no
    buffer goes back to the pool before its gather wrote it (releases poisoned)."""
    if _world() < 1:
        pytest.skip("needs a CUDA GPU")
    run_distributed(_gather_stream_worker, 1, backend="nccl", timeout=600)
