"""The optimizer's state is not carved out of the segments step 0 left wholly free ([Note: the state
in segments of its own] in zbuf/memory/step.py): at qwen3-32b as rank 0 of 8 on an 80 GiB card
the state, made in step 0's optimizer step, took the user's fp32 loss segment from step 0, and
``zbuf.compile(model, optimizer=opt)`` ran out of memory in step 1 asking for the loss again with
14.4 GiB of torch's cache free but in pieces (benches/results/onepath32b.md).

The check reads the allocator's own history: the segments wholly free as the optimizer step
begins (before zbuf's step hooks run), and after the step, the segment each state tensor lies in.
One that lies in such a segment must have had it released and mapped anew in between (a new
segment may reuse the address). One rank over NCCL, with a user's allocator settings without
expandable segments (zbuf's own turn them on, [Note: torch's allocator grows in place] in
zbuf/memory/shared.py, and a segment then grows in place): the case this emptying serves.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.cuda

VOCAB, HIDDEN = 1000, 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    """Every parameter's state is 4 MiB (the allocator's large blocks), the activations and the
    fp32 logits 32 MiB (segments of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _worker(rank, world):
    import zbuf.compile
    from zbuf.shard import shard

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = shard(Net().to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=1_000_000)
    mark: dict = {}

    def before_step(_opt, _args, _kwargs):
        if mark:
            return
        snap = torch.cuda.memory._snapshot()
        mark["events"] = len(snap["device_traces"][dev.index])
        mark["free"] = {(s["address"], s["total_size"]) for s in snap["segments"]
                        if s["device"] == dev.index and s["allocated_size"] == 0}

    opt.register_step_pre_hook(before_step)  # ahead of the hooks zbuf.compile installs
    compiled = zbuf.compile(model, optimizer=opt)
    tokens = torch.randint(0, VOCAB, (8, 1025), device=dev)
    logits = compiled(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    del logits
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][dev.index][mark["events"]:]
    released = {e["addr"] for e in events if e["action"] == "segment_free"}
    segments = [(s["address"], s["total_size"]) for s in snap["segments"]
                if s["device"] == dev.index]
    # Otherwise there was nothing the state could have been carved from, and this checks nothing.
    assert mark["free"], "step 0 left no segment wholly free"
    state = [v for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() and v.is_cuda]
    assert state
    for v in state:
        seg = next((a, n) for a, n in segments if a <= v.data_ptr() < a + n)
        assert seg not in mark["free"] or seg[0] in released, (
            f"a {v.numel() * v.element_size()}-byte state tensor lies in a segment that was "
            f"wholly free as the step began and was not released")
    return len(mark["free"]), len(released), len(state)


def test_the_state_is_not_carved_from_step_0s_free_segments():
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    print(run_distributed(_worker, 1, backend="nccl", timeout=600,
                          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}))
