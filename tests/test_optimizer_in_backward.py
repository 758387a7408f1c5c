"""The optimizer step in backward ([Note: optimizer in backward] in
zbuf/optimizer_in_backward.py): the same training as stepping after backward, without the
gradients held to the end of backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zbuf
import zbuf.compile
from dist_utils import run_distributed
from tied_net import TiedNet
from zbuf.compile import schedule_report
from zbuf.shard import shard

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

WARMUP = 2
"""Linear learning-rate warm-up from 0 ([Note: first Adam step] in test_compile_dist.py); it
also checks that a scheduler's changes reach the steps made in backward."""


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, step, opt, batches, *, in_backward: bool):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / WARMUP))
    losses = []
    for tokens in batches:
        loss = F.cross_entropy(step(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        if in_backward:  # every shard was stepped, and its gradient dropped, in backward
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _batches(rank: int = 0, world: int = 1, n: int = 4):
    g = torch.Generator().manual_seed(7)
    full = [torch.randint(0, 61, (4 * world, 8), generator=g) for _ in range(n)]
    return [b[4 * rank:4 * (rank + 1)] for b in full]


def _compiled_run(base, kind, in_backward, batches, inner="aot_eager"):
    torch._dynamo.reset()
    model = shard(copy.deepcopy(base))
    opt = _optimizer(kind, model.parameters())
    cm = zbuf.compile(model, inner=inner, optimizer=opt, optimizer_in_backward=in_backward,
                      fullgraph=True, structure="graph")  # the optimizer in backward's
    losses = _train(model, cm, opt, batches, in_backward=in_backward)
    memory = zbuf.compile.step_memory_of(cm)
    rows = list(memory.rows)
    memory.detach()
    return (losses, [p.detach().clone() for p in model.parameters()], model, opt, rows,
            memory.measured)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_stepping_in_backward_trains_as_stepping_after_it(kind):
    """Per parameter the update is the one ``opt.step()`` makes after backward: the same losses
    and parameters as zbuf stepping after backward (bit for bit: the same kernels on the same
    tensors) and as the unsharded model, with the optimizer's state where ``state_dict`` finds
    it."""
    torch.manual_seed(0)
    base = TiedNet()
    batches = _batches()
    after = _compiled_run(base, kind, False, batches)
    during = _compiled_run(base, kind, True, batches)
    assert during[0] == after[0]
    for p, q in zip(during[1], after[1]):
        assert torch.equal(p, q)
    reference = copy.deepcopy(base)
    opt = _optimizer(kind, reference.parameters())
    ref_losses = _train(reference, reference, opt, batches, in_backward=False)
    torch.testing.assert_close(during[0], ref_losses, rtol=1e-5, atol=0)
    for p, q in zip(during[1], reference.parameters()):
        torch.testing.assert_close(p.reshape(-1)[:q.numel()], q.detach().reshape(-1),
                                   rtol=1e-5, atol=1e-7)
    state = during[3].state_dict()["state"]
    assert len(state) == len(list(base.parameters()))
    if kind == "adamw":
        assert all(int(s["step"]) == len(batches) for s in state.values())


def test_no_gradient_outlives_backward_and_the_backward_plans_without_them():
    """The backward graph returns no gradient shard (each goes to ``zbuf::step_in_backward``),
    its projected profile holds them only where they are made, and the measured step's backward
    ends without them (CPU stand-in: the tracked bytes)."""
    torch.manual_seed(0)
    base = TiedNet(width=64)
    batches = _batches(n=2)
    after = _compiled_run(base, "adamw", False, batches)
    during = _compiled_run(base, "adamw", True, batches)
    (_, bw_after), (_, bw_during) = schedule_report(after[2]), schedule_report(during[2])
    assert "step_in_backward" in bw_during.op_order and "step_in_backward" not in bw_after.op_order
    grads = sum(p.numel() * p.element_size() for p in during[2].parameters())
    largest = max(p.numel() * p.element_size() for p in during[2].parameters())
    # At the backward's end: every gradient shard when stepping after it, none in it.
    assert bw_after.activation_profile[-1] >= grads
    assert bw_during.activation_profile[-1] <= bw_after.activation_profile[-1] - grads
    # The optimizer phase starts after backward, once: the steps inside backward are backward's.
    for a, b in zip(after[4][1:], during[4][1:]):  # step 0 creates the state in backward
        assert b.phases.backward_peak_bytes <= a.phases.backward_peak_bytes - grads


def test_the_state_made_in_backward_is_measured_once():
    """[Note: a state made inside the measured phase]: step 0's backward makes AdamW's state
    (two fp32 copies of the shards) as it steps; the measurement that sets the budget is step
    1's, which ran with the state resident throughout, so the state counts once and the
    measured backward is below stepping after backward's (which holds the gradients too)."""
    torch.manual_seed(0)
    base = TiedNet(width=64)
    batches = _batches(n=3)
    after = _compiled_run(base, "adamw", False, batches)
    during = _compiled_run(base, "adamw", True, batches)
    grads = sum(p.numel() * p.element_size() for p in during[2].parameters())
    assert after[5].measured_step == 0 and during[5].measured_step == 1
    assert during[5].backward_peak_bytes <= after[5].backward_peak_bytes - grads // 2


def test_offloading_the_state_learns_the_batch_order_and_trains_the_same(monkeypatch):
    """[Note: optimizer state off the device]: the batches come in one order every step, which
    the offload learns to prefetch by (on a CPU device the state stays in host memory, so the
    losses and parameters are those of the optimizer in backward without it, bit for bit)."""
    import zbuf.compile.passes as passes
    import zbuf.optimizer_offload as offload_mod

    monkeypatch.setattr(passes, "BATCH_BYTES", 16 << 10)  # several batches of this small model
    seen = []
    bring = offload_mod.StateOffload.bring
    monkeypatch.setattr(offload_mod.StateOffload, "bring",
                        lambda self, key, params: (seen.append((key, list(params))),
                                                   bring(self, key, params)))
    torch.manual_seed(0)
    base = TiedNet(width=64, blocks=4)
    batches = _batches(n=3)
    plain = _compiled_run(base, "adamw", True, batches)
    torch._dynamo.reset()
    model = shard(copy.deepcopy(base))
    opt = _optimizer("adamw", model.parameters())
    cm = zbuf.compile(model, inner="aot_eager", optimizer=opt, optimizer_in_backward=True,
                      offload_optimizer=True, fullgraph=True)
    losses = _train(model, cm, opt, batches, in_backward=True)
    assert losses == plain[0]
    for p, q in zip(model.parameters(), plain[1]):
        assert torch.equal(p.detach(), q)
    per_step = len(seen) // len(batches)
    keys = [key for key, _params in seen]
    assert per_step >= 3 and keys == keys[:per_step] * len(batches)
    offload = cm._zbuf_backward_step.offload
    for i, (key, _params) in enumerate(seen[:per_step]):
        following = seen[(i + 1) % per_step][1]
        assert [id(p) for p in offload.prefetched_after(key)] == [id(p) for p in following]
    assert {id(p) for _key, ps in seen[:per_step] for p in ps} == {
        id(p) for p in model.parameters()}
    zbuf.compile.step_memory_of(cm).detach()
    with pytest.raises(ValueError, match="offload_optimizer=True.*pass optimizer="):
        zbuf.compile(model, offload_optimizer=True, fullgraph=True)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
       batch=st.integers(1, 8000), kind=st.sampled_from(["adamw", "sgd"]))
def test_the_offloaded_reserve_covers_any_two_consecutive_batches(sizes, batch, kind):
    """[Note: optimizer state off the device]: the plan reserves, for state that lives in host
    memory, what two consecutive batches (the one stepping, the next prefetched) hold on the
    device, in any order of the gradients; never more than the whole state."""
    from zbuf.memory import OptimizerPolicy

    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = _optimizer(kind, params)
    policy = OptimizerPolicy.of(opt)
    reserve = policy.offloaded_state_bytes(opt, batch)
    assert reserve <= policy.state_bytes(params)
    for order in (params, params[::-1], sorted(params, key=lambda p: p.numel())):
        batches, current = [], []
        for p in order:  # as step_gradients_in_backward closes them
            current.append(p)
            if sum(q.numel() * 4 for q in current) >= batch:
                batches.append(current)
                current = []
        batches += [current] if current else []
        pairs = zip(batches, batches[1:] + batches[:1]) if len(batches) > 1 else [(batches[0], [])]
        for a, b in pairs:
            assert policy.state_bytes(a + b) <= reserve


def test_bad_combinations_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = shard(TiedNet())
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs optimizer="):
        zbuf.compile(model, inner="aot_eager", optimizer_in_backward=True, fullgraph=True)
    with pytest.raises(ValueError, match="needs fullgraph=True"):
        zbuf.compile(model, inner="aot_eager", optimizer=opt, optimizer_in_backward=True)
    cm = zbuf.compile(model, inner="aot_eager", optimizer=opt, optimizer_in_backward=True,
                      fullgraph=True)
    cm(_batches()[0]).sum().backward()
    # Nothing is left to clip: a norm of 0 and no clipping would be a silent change.
    with pytest.raises(zbuf.ShardingError, match="optimizer_in_backward"):
        zbuf.clip_grad_norm_(model, 1.0)
    zbuf.compile.step_memory_of(cm).detach()


def _two_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = TiedNet()
    batches = _batches(rank, world)
    after = _compiled_run(base, "adamw", False, batches)
    during = _compiled_run(base, "adamw", True, batches)
    same = all(torch.equal(p, q) for p, q in zip(during[1], after[1]))
    # Every rank ends with the same full parameters (the shards gathered).
    state = zbuf.full_state_dict(during[2])
    full = [state[k].tolist() for k in sorted(base.state_dict())]  # plain values across processes
    return {"losses": (during[0], after[0]), "same": same, "full": full}


def test_two_ranks_step_in_backward_as_after_it():
    """Sharded over two gloo ranks: each rank steps its own shards in backward, with the same
    result as stepping after backward."""
    results = run_distributed(_two_ranks, 2)
    for r in results:
        assert r["same"] and r["losses"][0] == r["losses"][1]
    assert results[0]["full"] == results[1]["full"]
