"""Tied weights are reduced once per backward (issue 3: "gathered once per use site and reduced
once"), eager ([Note: reduce once] in reduce_once.py) and compiled with the zbuf backend ([Note:
merging reduce-scatters] in compile/tied.py), with gradients exactly the unsharded reference's.

One 2-rank gloo launch runs every multi-rank check: eager bookkeeping under micro-batch orders,
dropped and no-grad forwards, checkpoint recompute (non-reentrant and reentrant) and a use that
never reaches the loss; then AdamW parity with the reference, eager and ``backend="zbuf"`` over
aot_eager (and Inductor with ``ZBUF_TEST_INDUCTOR=1``). The graph rewrite itself is also checked on
hand-built graphs in one process.
"""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_utils import global_mean, run_distributed

VOCAB, DIM, SEQ = 37, 13, 5  # primes: uneven shards
RTOL, ATOL = 1e-5, 1e-6
TRAINABLE = 3  # embed.weight (= head.weight), mid.weight, mid.bias


class TiedNet(nn.Module):
    """Embedding and output head share one weight; the head optionally runs under checkpoint, so
    backward's recompute gathers the tied weight again."""

    def __init__(self, head_ckpt: str | None = "non_reentrant") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.head_ckpt = head_ckpt

    def forward(self, tokens):
        x = F.gelu(self.mid(self.embed(tokens)))
        if self.head_ckpt is None:
            return self.head(x)
        return checkpoint(self.head, x, use_reentrant=self.head_ckpt == "reentrant")


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _data(world, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2 * world, SEQ), generator=g),
             torch.randint(0, VOCAB, (2 * world, SEQ), generator=g)) for _ in range(n)]


def _delta(model, before):
    from zbuf.shard import op_counts

    now = op_counts(model)
    return {k: now[k] - before.get(k, 0) for k in ("reduce_scatter", "reduce_scatter_flush", "grad_accumulate")}


def _check_grads(model, ref, rank, what):
    """Shard grads == this rank's slice of the reference's full grads, then both zeroed."""
    from zbuf.param import local_shard_of
    from zbuf.shard import sharded_parameters

    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    seen = set()
    for fqn, _, _, shard_p, spec in sharded_parameters(model):
        if spec.param_id in seen:
            continue
        seen.add(spec.param_id)
        want = local_shard_of(ref_grads[fqn].grad, spec.shard_numel, rank)
        assert shard_p.grad is not None, f"{what}: {fqn} got no gradient"
        torch.testing.assert_close(shard_p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {fqn}: {m}")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def _eager_scenarios(rank, world):
    """Each scenario: sharded grads vs the reference's, and the exact collective count."""
    from zbuf import reduce_once
    from zbuf.shard import op_counts, root_of, shard

    results = {}
    torch.manual_seed(0)
    init = TiedNet()
    (t1, y1), (t2, y2) = _data(world, 2, seed=5)
    mine = lambda t: t.chunk(world)[rank]  # noqa: E731

    def run(name, sharded_fn, ref_fn, model, ref):
        before = op_counts(model)
        sharded_fn(model)
        results[name] = _delta(model, before)
        ref_fn(ref)
        _check_grads(model, ref, rank, name)
        assert root_of(model).reduce_once.open_accumulators() == 0, name

    for ckpt in ("non_reentrant", None, "reentrant"):
        init.head_ckpt = ckpt
        model, ref = shard(copy.deepcopy(init)), copy.deepcopy(init)
        run(f"step[{ckpt}]",
            lambda m: _ce(m(mine(t1)), mine(y1)).backward(),
            lambda r: _ce(r(t1), y1).backward(), model, ref)
    init.head_ckpt = "non_reentrant"
    model, ref = shard(copy.deepcopy(init)), copy.deepcopy(init)
    # Two forwards, one backward of the summed losses.
    run("fwd,fwd,bwd(sum)",
        lambda m: (_ce(m(mine(t1)), mine(y1)) + _ce(m(mine(t2)), mine(y2))).backward(),
        lambda r: (_ce(r(t1), y1) + _ce(r(t2), y2)).backward(), model, ref)

    # Two forwards, then their backwards one by one (in either order).
    def separate(m, first=0):
        losses = [_ce(m(mine(t1)), mine(y1)), _ce(m(mine(t2)), mine(y2))]
        losses[first].backward()
        losses[1 - first].backward()

    run("fwdA,fwdB,bwdA,bwdB", separate, lambda r: (_ce(r(t1), y1) + _ce(r(t2), y2)).backward(), model, ref)
    run("fwdA,fwdB,bwdB,bwdA", lambda m: separate(m, 1),
        lambda r: (_ce(r(t1), y1) + _ce(r(t2), y2)).backward(), model, ref)

    # A forward whose output is dropped (evaluation with grad on), and one under no_grad, first.
    def dropped_then_step(m):
        m(mine(t2))
        with torch.no_grad():
            m(mine(t2))
        _ce(m(mine(t1)), mine(y1)).backward()

    run("dropped,no_grad,step", dropped_then_step, lambda r: _ce(r(t1), y1).backward(), model, ref)
    # Only the dropped forward's counts are left (its 4 gathers with grad), until newer forwards
    # push its generation out.
    assert root_of(model).reduce_once.open_uses() == TRAINABLE + 1

    # A use of the tied weight that never reaches the loss: its count is left over at the end of
    # the backward, which then reduce-scatters the held accumulator itself.
    def unused_use(m):
        loss = _ce(m(mine(t1)), mine(y1))
        m.embed.weight.sum()
        loss.backward()

    run("unused use", unused_use, lambda r: _ce(r(t1), y1).backward(), model, ref)
    assert root_of(model).reduce_once.open_uses() == TRAINABLE + 1
    for _ in range(reduce_once.MAX_OPEN_GENERATIONS):
        with torch.no_grad():
            model(mine(t1))
    assert root_of(model).reduce_once.open_uses() == 0
    return results


def _train(step_model, model, batches, rank, world, *, sharded):
    from zbuf.shard import op_counts

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, per_step = [], []
    for tokens, targets in batches:
        if sharded:
            tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        before = op_counts(model)
        loss = _ce(step_model(tokens), targets)
        loss.backward()
        per_step.append(_delta(model, before))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(global_mean(loss, world, sharded))
    return losses, per_step


def _parity(rank, world, inners):
    """AdamW steps: eager and compiled zbuf match the unsharded reference at 1e-5."""
    from zbuf.compile import schedule_report
    from zbuf.shard import shard
    from zbuf.state_dict import full_state_dict

    torch.manual_seed(1)
    init = TiedNet()
    batches = _data(world, 4, seed=7)
    ref = copy.deepcopy(init)
    ref_losses, _ = _train(ref, ref, batches, rank, world, sharded=False)
    out = {}
    for mode in ["eager", *inners]:
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init))
        step_model = model if mode == "eager" else torch.compile(
            model, backend="zbuf", options=dict(inner=mode), fullgraph=True)
        losses, per_step = _train(step_model, model, batches, rank, world, sharded=True)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0,
                                   msg=lambda m: f"{mode} losses: {m}")
        sd, ref_sd = full_state_dict(model), ref.state_dict()
        for key, value in ref_sd.items():
            torch.testing.assert_close(sd[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{mode} {key}: {m}")
        rec = {"per_step": per_step}
        if mode != "eager":
            rec["backward_ops"] = [list(r.op_order) for r in schedule_report(model) if r.kind == "backward"]
        out[mode] = rec
    return out


def _tied_worker(rank, world, inners):
    return {"eager": _eager_scenarios(rank, world), "parity": _parity(rank, world, inners)}


def test_tied_weight_reduced_once_eager_and_compiled():
    inners = ["aot_eager"] + (["inductor"] if os.environ.get("ZBUF_TEST_INDUCTOR") == "1" else [])
    reports = run_distributed(_tied_worker, 2, inners, timeout=600)
    assert reports[0] == reports[1]  # every rank issued the same collectives
    eager = reports[0]["eager"]
    one_each = {"reduce_scatter": TRAINABLE, "reduce_scatter_flush": 0, "grad_accumulate": 1}
    # One reduce-scatter per trainable parameter: the tied weight's two contributions are summed
    # locally (one accumulate) whatever the head's checkpointing, except under reentrant
    # checkpoint, whose recompute is backpropagated on its own (a nested backward).
    assert eager["step[non_reentrant]"] == one_each
    assert eager["step[None]"] == one_each
    assert eager["step[reentrant]"] == {"reduce_scatter": TRAINABLE + 1, "reduce_scatter_flush": 0,
                                        "grad_accumulate": 0}
    # Several forwards: each forward's uses are reduced once, in one backward or in separate ones.
    two_each = {"reduce_scatter": 2 * TRAINABLE, "reduce_scatter_flush": 0, "grad_accumulate": 2}
    assert eager["fwd,fwd,bwd(sum)"] == two_each
    assert eager["fwdA,fwdB,bwdA,bwdB"] == two_each
    assert eager["fwdA,fwdB,bwdB,bwdA"] == two_each
    # Dropped and no-grad forwards change nothing for the next step.
    assert eager["dropped,no_grad,step"] == one_each
    # A use that never contributes: both real contributions are held (a third use is pending),
    # and the end of the backward reduce-scatters their sum.
    assert eager["unused use"] == {"reduce_scatter": TRAINABLE, "reduce_scatter_flush": 1, "grad_accumulate": 2}

    parity = reports[0]["parity"]
    for mode, rec in parity.items():
        for step in rec["per_step"]:
            assert step["reduce_scatter"] == TRAINABLE, (mode, rec["per_step"])
            assert step["reduce_scatter_flush"] == 0, (mode, rec["per_step"])
        if mode != "eager":
            # In the compiled backward graph: one reduce-scatter (start + wait) per parameter.
            (ops,) = rec["backward_ops"]
            assert ops.count("reduce_scatter_start") == ops.count("reduce_scatter_wait") == TRAINABLE, ops


# ---------------------------------------------------------------------------------------------
# The graph rewrite on hand-built backward graphs (one process, a 1-rank group).




def _rs_graph(group, n_uses, *, reduce_dtype=None, extra_use=False):
    """grads g0..g{n-1} -> reduce_scatter each -> summed by a chain of adds -> output."""
    rs_op = torch.ops.zbuf.reduce_scatter.default
    graph = torch.fx.Graph()
    shape, numel = (5, 7), 35
    grads, rss = [], []
    for i in range(n_uses):
        g = graph.placeholder(f"g{i}")
        g.meta["val"] = torch.empty(shape)
        grads.append(g)
    for g in grads:
        rs = graph.call_function(rs_op, (g, 123, numel, group, reduce_dtype, torch.float32))
        rs.meta["val"] = torch.empty(numel)
        rss.append(rs)
    total = rss[0]
    for rs in rss[1:]:
        total = graph.call_function(torch.ops.aten.add.Tensor, (total, rs))
        total.meta["val"] = torch.empty(numel)
    outs = [total]
    if extra_use:  # the first reduce-scatter's result is read on its own as well
        outs.append(graph.call_function(torch.ops.aten.mul.Tensor, (rss[0], 2.0)))
    graph.output(tuple(outs))
    return graph


@pytest.mark.parametrize("n_uses,reduce_dtype", [(2, None), (3, None), (3, torch.float64)])
def test_merge_sums_then_reduces_once(one_rank_group, n_uses, reduce_dtype):
    import zbuf.runtime
    from zbuf.compile.tied import merge_reduce_scatters

    graph = _rs_graph(one_rank_group, n_uses, reduce_dtype=reduce_dtype)
    original = torch.fx.GraphModule({}, copy.deepcopy(graph))
    assert merge_reduce_scatters(graph) == n_uses - 1
    rs_nodes = [n for n in graph.nodes if n.target is torch.ops.zbuf.reduce_scatter.default]
    assert len(rs_nodes) == 1
    # The one reduce-scatter stays where the last one was: after every gradient it sums.
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert all(order[p] < order[rs_nodes[0]] for p in graph.nodes if p.op == "placeholder")
    merged = torch.fx.GraphModule({}, graph)
    grads = [torch.randn(5, 7) for _ in range(n_uses)]
    counts = collections.Counter()  # parameter 123 of no model: counted where the test looks
    zbuf.runtime.count_into([123], counts)
    (got,) = merged(*grads)
    assert counts["reduce_scatter"] == 1
    (want,) = original(*grads)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    exact = sum(g.double() for g in grads).flatten().float() if reduce_dtype else sum(grads).flatten()
    torch.testing.assert_close(got, exact, rtol=0, atol=0)


def test_merge_leaves_other_uses_alone(one_rank_group):
    """A reduce-scatter result read outside the gradient sum: merging would change the graph's
    meaning, so the reduce-scatters stay separate (still exact)."""
    from zbuf.compile.tied import merge_reduce_scatters

    graph = _rs_graph(one_rank_group, 2, extra_use=True)
    assert merge_reduce_scatters(graph) == 0
    assert sum(n.target is torch.ops.zbuf.reduce_scatter.default for n in graph.nodes) == 2


def test_two_models_keep_their_own_reduce_once_state(one_rank_group):
    """Each sharded root counts its own forwards' uses ([Note: reduce once]): forwards of one
    model neither show in the other's counts nor push the other's generations out."""
    from zbuf import reduce_once
    from zbuf.shard import root_of, shard

    torch.manual_seed(0)
    a, b = shard(TiedNet(head_ckpt=None)), shard(TiedNet(head_ckpt=None))
    (tokens, _), = _data(1, 1, seed=3)
    a(tokens)  # dropped with grad on: its counts stay until its generation is pushed out
    assert root_of(a).reduce_once.open_uses() == TRAINABLE + 1
    assert root_of(b).reduce_once.open_uses() == 0
    b(tokens)
    assert root_of(b).reduce_once.open_uses() == TRAINABLE + 1
    with torch.no_grad():
        for _ in range(reduce_once.MAX_OPEN_GENERATIONS):
            b(tokens)
    assert root_of(a).reduce_once.open_uses() == TRAINABLE + 1
    assert root_of(b).reduce_once.open_uses() == 0
    assert root_of(a).regather.live_tracked() == 0 == root_of(b).regather.live_tracked()
