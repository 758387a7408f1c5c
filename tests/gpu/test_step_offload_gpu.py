"""The optimizer's state offloaded for a step after backward, on CUDA ([Note: optimizer state
offloaded after backward] in zbuf/optimizer_step_offload.py): pinned host copies, two device
slots during the step, copies on their own streams; the same updates bit for bit, the state's device memory
given back, the compute stream's waits measured."""

import gc

import pytest
import torch

from zbuf.optimizer_step_offload import StepOffload

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(1 << 20,), (2048, 1024), (3, 1 << 19), (1 << 21,), (4096, 512), (1000, 1000)]


def _run(offload: bool, steps: int = 4, fused: bool = True):
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in SHAPES]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused)
    off = StepOffload(opt, torch.device("cuda"), bucket_bytes=12 << 20) if offload else None
    gc.collect()  # an earlier run's optimizer and offload (their hooks make cycles) go now
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what an earlier run in this process still holds
    held = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        # Work on the compute stream that the first uploads can hide behind.
        a = torch.randn(2048, 2048, device="cuda", generator=g)
        for _ in range(20):
            a = a @ a / 2048
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
    if off is not None:
        off.settle()
    return params, opt, off, held


@pytest.mark.parametrize("fused", [True, False])
def test_offloaded_step_matches_the_state_on_the_device_bit_for_bit(fused):
    ref, ref_opt, _, held_ref = _run(False, fused=fused)
    got, opt, off, held = _run(True, fused=fused)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for pa, pb in zip(ref, got):
        for k, v in ref_opt.state[pa].items():
            w = opt.state[pb][k]
            if v.dim():
                assert w.device.type == "cpu" and w.is_pinned()
            assert torch.equal(v.cpu(), w.cpu()), k
    # Between steps the device holds none of the moments (the slots live in the step only).
    state = sum(2 * p.numel() * 4 for p in ref)
    assert held[-1] <= held_ref[-1] - state + (1 << 20)
    rep = off.report()
    assert rep["bytes_moved_per_step"] >= 2 * state
    assert rep["exposed_ms_median"] is not None and rep["exposed_ms_median"] >= 0
    assert len(rep["steps"]) == 4


def test_loading_the_state_never_puts_it_on_the_device():
    """[Note: loading streamed state]: a resume copies the offloaded state straight into the
    host regions; torch's load alone would hold all of it on the device at once."""
    params, opt, off, _ = _run(True, steps=2)
    saved = opt.state_dict()
    state = sum(2 * p.numel() * 4 for p in params)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = torch.optim.AdamW(params2, lr=1e-3, weight_decay=0.1, fused=True)
    off2 = StepOffload(opt2, torch.device("cuda"), bucket_bytes=12 << 20)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt2.load_state_dict(saved)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < state // 8
    assert off2.host_held_bytes() == state
    for p in params2:
        assert all(v.device.type == "cpu" for v in opt2.state[p].values() if v.dim())


def _plain(base, batches, offload):
    """``zbuf.compile(model, optimizer=opt)`` and the user's loop, stepping after backward;
    returns the parameters, the offload's record and each step's allocated peak."""
    import copy
    import gc

    import torch.nn.functional as F

    import zbuf
    import zbuf.compile
    from zbuf.shard import shard

    torch._dynamo.reset()
    gc.collect()
    model = shard(copy.deepcopy(base).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    cm = zbuf.compile(model, optimizer=opt, inner="aot_eager", offload_optimizer=offload)
    for tokens, targets in batches:
        F.cross_entropy(cm(tokens).flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    memory = zbuf.compile.step_memory_of(cm)
    report = memory.report()["optimizer_offload"]
    peaks = [r.phases.allocated_peak_bytes for r in memory.rows]
    memory.detach()
    torch.cuda.synchronize()
    return [p.detach().cpu().clone() for p in model.parameters()], report, peaks


def _kept_and_moved(width, batch, steps):
    """The same TiedNet trained with the state on the device and offloaded (deterministic
    kernels: [Note: optimizer state off the device]'s GPU test says why): both runs' results."""
    import torch.distributed as dist
    from tied_net import TiedNet

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    base = TiedNet(vocab=97, width=width, blocks=4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 97, batch, generator=g).cuda(),
                torch.randint(0, 97, batch, generator=g).cuda()) for _ in range(steps)]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _plain(base, batches, False), _plain(base, batches, True)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_the_plain_loop_offloaded_on_cuda_trains_bit_for_bit(monkeypatch):
    """The default path (one frame per block, the user's ``opt.step()`` after backward) with
    the state streamed through the step's slots on CUDA's copy streams: the same floats as
    with the state on the device."""
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 16 << 10)  # several buckets
    (kept, none, _), (moved, rep, _) = _kept_and_moved(width=64, batch=(4, 32), steps=4)
    assert none is None
    for a, b in zip(kept, moved):
        assert torch.equal(a, b)
    assert rep["chosen_by"] == "user" and rep["buckets"] > 2
    assert [s["uploaded_bytes"] for s in rep["steps"]][1:] == [rep["bytes_moved_per_step"] // 2] * 3


def test_the_window_trains_bit_for_bit_on_cuda_and_never_raises_the_steps_peak(monkeypatch):
    """[Note: the step's window] in zbuf/offload_window.py on CUDA's copy streams: a model whose
    activations dominate its step (a long batch), the state offloaded; the window is sized from
    the first settled step's profile, the steps after it upload ahead in backward and release in
    the next forward, train the same floats as the state on the device, and peak no higher than
    the profiled step did."""
    import zbuf.memory.progress
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 64 << 10)  # many buckets
    monkeypatch.setattr(zbuf.memory.progress, "MARK_BYTES", 64 << 10)  # points in backward
    (kept, _, _), (moved, rep, peaks) = _kept_and_moved(width=128, batch=(16, 1024), steps=8)
    for a, b in zip(kept, moved):
        assert torch.equal(a, b)
    assert rep["window"] is not None, rep
    profiled = rep["window_sized_from"]["step"]
    assert max(peaks[profiled + 1:]) <= peaks[profiled] + (1 << 20), peaks
    assert [s["uploaded_bytes"] for s in rep["steps"]][1:] == [rep["bytes_moved_per_step"] // 2] * 7
