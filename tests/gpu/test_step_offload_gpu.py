"""The optimizer's state offloaded for a step after backward, on CUDA ([Note: optimizer state
offloaded after backward] in zbuf/optimizer_step_offload.py): pinned host copies, two device
slots during the step, copies on their own streams; the same updates bit for bit, the state's device memory
given back, the compute stream's waits measured."""

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
        held.append(torch.cuda.memory_allocated())
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
