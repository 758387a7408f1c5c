"""A checkpointed forward that sets and resets outside state while compiling, as Hugging Face
transformers 5.25's kernel routing does in every attention layer ([Note: forward side effects
under checkpoint] in compile/dynamo_settings.py): every structure zbuf.compile builds traces it
whole, trains as the unsharded reference does, leaves the state as it found it, and leaves the
caller's Dynamo setting as it was. Independent of the installed transformers version.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zbuf.compile
from zbuf.compile import schedule_report
from zbuf.compile.block_frames import block_frames_of
from zbuf.shard import shard

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py


class _Routing:
    """Outside state a forward writes while compiling (``kernels``' ``CompileableContextVar``)."""

    def __init__(self):
        self.active = None


ROUTING = _Routing()


class _RoutedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def _body(self, x):
        prior = ROUTING.active
        ROUTING.active = self.up
        try:
            return x + self.down(torch.tanh(self.up(x)))
        finally:
            ROUTING.active = prior

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False)


class _Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Linear(16, 16)  # every block's input needs a gradient: one frame graph
        self.layers = nn.ModuleList(_RoutedBlock() for _ in range(layers))

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x.square().mean()


def _train(fn, model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x in batches:
        lo = fn(x)
        lo.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(lo.item())
    return losses


def _stack_and_reference():
    """A 3-block ``_Stack``, its sharded copy, two batches, and the unsharded reference's losses
    on them."""
    torch.manual_seed(0)
    init = _Stack(3)
    batches = [torch.randn(4, 16) for _ in range(2)]
    ref = copy.deepcopy(init)
    return shard(copy.deepcopy(init)), batches, _train(ref, ref, batches)


@pytest.mark.parametrize("options", [{"structure": "graph"}, {"structure": "blocks"}],
                         ids=["graph", "frames"])
def test_checkpointed_side_effects_trace_whole(options, recwarn):
    model, batches, ref_losses = _stack_and_reference()
    cm = zbuf.compile(model, inner="aot_eager", fullgraph=True, budget_bytes=1 << 30, **options)
    losses = _train(cm, model, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    assert ROUTING.active is None
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False
    assert not [w for w in recwarn if "compiled no graph" in str(w.message)]
    if options["structure"] == "blocks":
        assert block_frames_of(model).graphs_compiled == 1
    else:
        assert {r.graph_id for r in schedule_report(model)}  # the zbuf backend planned the step


def test_a_block_frame_that_compiles_nothing_says_so(monkeypatch):
    """Without the setting, the side effect breaks the graph at the checkpoint and the frame
    compiles no graph: the blocks still train as the reference's, eager, and the user is told
    once, in one line that names the block and the way to the break."""
    import zbuf.compile.block_frames as block_frames

    monkeypatch.setattr(block_frames, "traced_as_zbuf", lambda compiled: compiled)
    model, batches, ref_losses = _stack_and_reference()
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks")
    with pytest.warns(UserWarning, match="compiled no graph for the frame of _RoutedBlock") as seen:
        losses = _train(cm, model, batches)
    told = [str(w.message) for w in seen if "compiled no graph" in str(w.message)]
    assert len(told) == 1 and "\n" not in told[0] and "fullgraph=True" in told[0]
    assert block_frames_of(model).graphs_compiled == 0
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
