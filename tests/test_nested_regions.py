"""A model's own nested compile regions (``torch.compiler.nested_compile_region``) under zbuf's
whole graph, one process ([Note: region bodies] in zbuf/compile/region_graphs.py): a region handed
gathered weights trains like the unsharded model with the gathers planned on the outer graph, a
region that gathers inside its body is refused, and so is a region called under the caller's
checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zbuf.compile
from zbuf.compile import region_graphs
from zbuf.shard import shard

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

REGION = torch.ops.higher_order.invoke_subgraph


@torch.compiler.nested_compile_region
def _mlp(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + torch.tanh(x @ w1.t()) @ w2.t()


class _Block(nn.Module):
    def __init__(self, through_region: bool, under_checkpoint: bool = False):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.through_region = through_region
        self.under_checkpoint = under_checkpoint

    def forward(self, x):
        if not self.through_region:
            return x + torch.tanh(self.up(x)) @ self.down.weight.t()
        w1, w2 = self.up.weight, self.down.weight  # gathered here, outside the region
        if self.under_checkpoint:
            return checkpoint(_mlp, w1, w2, x, use_reentrant=False)
        return _mlp(w1, w2, x)


class _Stack(nn.Module):
    def __init__(self, **block):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(**block) for _ in range(3))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x).pow(2).mean()


def _train(step_fn, model, steps: int = 3) -> list[float]:
    """AdamW over the same batches for every model; the losses."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = step_fn(torch.randn(4, 8, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_a_region_handed_gathered_weights_trains_like_the_unsharded_model(monkeypatch):
    """The weights are gathered outside the region and handed in: the body is traced once, the
    gathers stay on the outer graph, and backward re-gathers them rather than keeping each
    block's full weights alive through the region's saved results (step 2 of the Note)."""
    forwarded = []
    forward_region_inputs = region_graphs.forward_region_inputs

    def spy(joint):
        forwarded.append(forward_region_inputs(joint))
        return forwarded[-1]

    import zbuf.compile.passes as passes
    monkeypatch.setattr(passes, "forward_region_inputs", spy)
    init = _Stack(through_region=True)
    plain = _Stack(through_region=False)
    plain.load_state_dict(init.state_dict())
    reference = _train(plain, plain)
    model = shard(copy.deepcopy(init))
    cm = zbuf.compile(model, structure="graph", inner="aot_eager", fullgraph=True)
    losses = _train(cm, model)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert forwarded and forwarded[0] > 0
    records = zbuf.compile.schedule_report(model)
    assert records and all(r.gathers > 0 for r in records)  # the gathers are the outer graph's


def test_gathers_inside_a_region_are_refused():
    """A region around code that reads sharded parameters would hide its gathers from the plan;
    the error says what to do instead."""
    blocks = shard(nn.ModuleList(_Block(through_region=False) for _ in range(2)))
    body = torch.compiler.nested_compile_region(lambda b, x: b(x))

    def f(x):
        for b in blocks:
            x = body(b, x)
        return x.sum()

    cf = torch.compile(f, backend="zbuf", options={"inner": "aot_eager"}, fullgraph=True)
    with pytest.raises(Exception, match="gathers sharded parameters inside its body.*pass them in"):
        cf(torch.randn(3, 8, requires_grad=True)).backward()


def test_a_region_under_the_callers_checkpoint_is_refused():
    model = shard(_Stack(through_region=True, under_checkpoint=True))
    cm = zbuf.compile(model, structure="graph", inner="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="nested_compile_region is called under "
                                        "torch.utils.checkpoint.*checkpoint inside the region"):
        cm(torch.randn(4, 8)).backward()
