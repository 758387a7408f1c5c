"""The optimizer step in backward on CUDA under Inductor ([Note: optimizer in backward] in
zbuf/optimizer_in_backward.py): the backward runs on autograd's device thread and Inductor
compiles the graph that returns no gradient shards. Same parameters as stepping after backward.
(The memory a step saves is measured by benches/memfloor.py on qwen3-1.7b:
benches/results/floor17b.md.)"""

from __future__ import annotations

import copy
import gc
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tied_net import TiedNet

pytestmark = pytest.mark.cuda

STEPS = 3


def _run(base, in_backward: bool, batches, *, offload: bool = False, fused: bool = False,
         keep: Optional[dict] = None, inner: str = "inductor", loss=None):
    import zbuf
    import zbuf.compile
    from zbuf.shard import shard

    if loss is None:
        from zbuf.models import loss

    torch._dynamo.reset()
    gc.collect()
    model = shard(copy.deepcopy(base).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    # From lr 0: Adam's first step is a sign step that turns rounding differences of
    # near-zero gradients (two Inductor graphs) into lr-sized ones ([Note: first Adam step]).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
    # One structure for both (the optimizer in backward is the whole graph's): what differs is
    # when the optimizer steps, not the kernels.
    cm = zbuf.compile(model, optimizer=opt, optimizer_in_backward=in_backward, fullgraph=True,
                      inner=inner, offload_optimizer=offload, structure="graph")
    for tokens, targets in batches:
        value = loss(cm, tokens, targets)
        value.backward()
        if in_backward:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    zbuf.compile.step_memory_of(cm).detach()
    if keep is not None:
        # Copies and facts only: the next run's memory must not hold this one's tensors.
        keep["state"] = {k: {n: v.cpu().clone() for n, v in st.items()}
                         for k, st in opt.state_dict()["state"].items()}
        keep["moments"] = [(v.device.type, v.is_pinned(), v.numel() * v.element_size())
                           for st in opt.state.values() for k, v in st.items()
                           if k.startswith("exp_avg")]
        # The optimizer's device footprint: what letting go of its state (and of what the
        # offload holds for it) frees.
        backward_step = cm.__dict__.get("_zbuf_backward_step")
        offload = backward_step.offload if backward_step is not None else None
        keep["held"] = offload.held_bytes() if offload is not None else 0
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        opt.state.clear()
        if offload is not None:
            offload.detach()
            backward_step.offload = offload = None
        gc.collect()
        torch.cuda.synchronize()
        keep["freed"] = before - torch.cuda.memory_allocated()
    return [p.detach().clone() for p in model.parameters()]


def _tiny_and_batches():
    from zbuf.models import build_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    base = build_model("tiny")
    g = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    batches = [(torch.randint(0, vocab, (4, 64), generator=g).cuda(),
                torch.randint(0, vocab, (4, 64), generator=g).cuda()) for _ in range(STEPS)]
    return base, batches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_in_backward_on_cuda_matches_stepping_after_it():
    base, batches = _tiny_and_batches()
    after = _run(base, False, batches)
    during = _run(base, True, batches)
    for p, q in zip(during, after):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _net_loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_offloaded_state_trains_bit_for_bit_and_leaves_the_device(fused, monkeypatch):
    """[Note: optimizer state off the device]: the moments live in pinned host memory between
    steps, arrive one batch ahead (several batches: a small BATCH_BYTES), and the updates are the
    same floats as with the state on the device; after the step the device holds only what the
    offload prefetched for the next one."""
    import zbuf.compile.passes as passes

    monkeypatch.setattr(passes, "BATCH_BYTES", 16 << 10)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    base = TiedNet(vocab=97, width=64, blocks=4)  # kernels with deterministic versions
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 97, (4, 32), generator=g).cuda(),
                torch.randint(0, 97, (4, 32), generator=g).cuda()) for _ in range(STEPS)]
    on_device, offloaded = {}, {}
    # Bit for bit needs the same floats from every backward: eager kernels, deterministic
    # versions (on 85be1ec this test compared the decoder under Inductor and failed bit for bit:
    # atomic adds in its backward, or a fault of the offload; this model tells them apart).
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        plain = _run(base, True, batches, fused=fused, keep=on_device, inner="aot_eager",
                     loss=_net_loss)
        moved = _run(base, True, batches, fused=fused, offload=True, keep=offloaded,
                     inner="aot_eager", loss=_net_loss)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for p, q in zip(moved, plain):
        assert torch.equal(p, q)
    assert all(device == "cuda" for device, _, _ in on_device["moments"])
    assert all(device == "cpu" and pinned for device, pinned, _ in offloaded["moments"])
    for k, st in on_device["state"].items():
        for name, v in st.items():
            assert torch.equal(offloaded["state"][k][name], v), (k, name)
    # What stays on the device is what the offload holds for the next step (the first batch,
    # prefetched), at most two batches' worth ([Note: the state's device blocks stay with the
    # compute stream]); state_dict let the downloads go.
    moments = sum(nbytes for _, _, nbytes in on_device["moments"])
    assert on_device["freed"] >= moments
    assert offloaded["held"] < 0.5 * moments
    # (slack: the allocator rounds each block to 512 bytes; fused AdamW keeps its step counts on
    # the device)
    assert offloaded["freed"] <= offloaded["held"] + 32 * 512


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_state_keeps_two_batches_on_the_device_while_downloads_lag():
    """[Note: the state's device blocks stay with the compute stream]: steps issued far faster
    than the host link moves their state (16 MiB shards, AdamW, one shard a batch) reserve two
    batches' state, not the queue of downloads, and give AdamW's floats on the device exactly."""
    from zbuf.optimizer_offload import StateOffload

    torch.manual_seed(0)
    n, numel = 32, 4 << 20
    shard_bytes = numel * 4
    device = torch.device("cuda", torch.cuda.current_device())
    moved = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n)]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in moved]
    opt_moved = torch.optim.AdamW(moved, lr=1e-2)
    opt_plain = torch.optim.AdamW(plain, lr=1e-2)
    offload = StateOffload(opt_moved, device)
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(i)).to(device)
             for i in range(4)]

    def step_batches(opt, params, offload=None):
        everything = opt.param_groups
        for i, p in enumerate(params):
            p.grad = grads[i % len(grads)] * (1 + i)
            if offload is not None:
                offload.bring((i,), [p])
            opt.param_groups = [dict(everything[0], params=[p])]
            try:
                opt.step()
            finally:
                opt.param_groups = everything
                p.grad = None
            if offload is not None:
                offload.put_back((i,), [p])

    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        step_batches(opt_moved, moved, offload)
        torch.cuda.synchronize()
        grown = torch.cuda.max_memory_reserved() - before
        # The whole state is 2 x 32 shards (1 GiB); a step holds its batch's state and gradient
        # and foreach temporaries, the batch downloading and the one uploading.
        assert grown <= 16 * shard_bytes, (step, grown / 2**20)
        step_batches(opt_plain, plain)
    offload.settle()
    for p, q in zip(moved, plain):
        assert torch.equal(p, q)
    for p, q in zip(moved, plain):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt_moved.state[p][k].device.type == "cpu"
            assert torch.equal(opt_moved.state[p][k], opt_plain.state[q][k].cpu())
