"""Budgeted recompute on real graphs (compile/recompute.py), one process.

The joint graph of a small checkpointed decoder is captured once; every example then partitions
it under a random graph memory M with ``recompute="auto"`` and plans the gathers of the two
graphs, as the backend does, and checks the property the plan promises ([Note: budgeted
recompute]): at every node of the forward and the backward graph, projected activations plus
live gathered bytes (plus the weights kept from forward, in backward) stay within M, unless even
recomputing everything cannot fit, which is reported as a raised budget.
Parity of ``auto`` with the unsharded reference on 2 and 3 ranks is in test_compile_dist.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbuf.compile import CompileOptions, recompute, schedule_report
from zbuf.compile import budget as budget_mod
from zbuf.compile.graph_info import activation_profile, summarize
from zbuf.compile.passes import ZbufPartitioner
from zbuf.compile.persist import tag_for_regather
from zbuf.compile.report import clear_records
from zbuf.compile.schedule import plan_schedule

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py

MAX_EXAMPLES = max(1, int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150")) // 10)


def _decoder(layers=3, checkpointed=True):
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=layers, vocab_size=97)
    torch.manual_seed(0)
    model = build_model(cfg)
    return apply_activation_checkpointing(model) if checkpointed else model


@pytest.fixture(scope="module")
def joint():
    """(joint graph module, partitioner kwargs, example inputs) of a 3-block decoder."""
    return _joint_of(_decoder())


def _joint_of(model):
    from zbuf.models import loss
    from zbuf.shard import shard

    torch._dynamo.reset()
    captured = {}
    real = ZbufPartitioner.__call__

    def capture(self, gm, joint_inputs, **kwargs):
        captured["gm"] = recompute.copy_joint(gm)
        captured["inputs"] = joint_inputs
        captured["kwargs"] = dict(kwargs, compiler="inductor")
        captured["fake_mode"] = torch._guards.detect_fake_mode(joint_inputs)
        return real(self, gm, joint_inputs, **kwargs)

    ZbufPartitioner.__call__ = capture
    try:
        model = shard(model)
        cm = torch.compile(model, backend="zbuf", fullgraph=True, options={"inner": "aot_eager"})
        tokens = torch.randint(0, 97, (4, 64), generator=torch.Generator().manual_seed(1))
        loss(cm, tokens, tokens).backward()
    finally:
        ZbufPartitioner.__call__ = real
        torch._dynamo.reset()
    return captured


def _partition(joint, opts):
    from torch._functorch.partitioners import min_cut_rematerialization_partition


    def min_cut(gm):
        return min_cut_rematerialization_partition(gm, joint["inputs"], **joint["kwargs"])

    # As inside a compile: the partitioner finds the fake mode through the tracing context.
    with torch._guards.tracing(torch._guards.TracingContext(joint["fake_mode"])):
        return recompute.partition(recompute.copy_joint(joint["gm"]),
                                               joint["kwargs"]["num_fwd_outputs"], opts, min_cut,
                                   lambda g, peak: tag_for_regather(g, opts, peak))


def _total_profile(graph, memory, persistent_bytes, opts):
    """Activations + planned live gathered bytes (+ weights kept from forward) per node, planned
    as GatherSchedulePass plans it; and whether the gather budget had to be raised."""
    index = summarize(graph, opts)  # localizes view chains first, as the pass does
    act = activation_profile(graph)
    requested = max(1, memory - int(act.max(initial=0)) - persistent_bytes)
    if not index.gathers:
        return act + persistent_bytes, False
    sched = plan_schedule(index.summary, requested, opts)
    return act + sched.profile + persistent_bytes, sched.budget_bytes > requested


@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(memory=st.integers(1 << 20, 80 << 20), persist=st.booleans())
def test_auto_keeps_activations_and_gathers_within_the_agreed_memory(joint, memory, persist,
                                                                     monkeypatch):
    opts = CompileOptions(recompute="auto", inner="aot_eager", persist=persist)
    monkeypatch.setattr(budget_mod, "graph_memory", lambda options, device, reserve=0: memory)
    fw, bw, kept, stats = _partition(joint, opts)
    assert stats.mode == "auto" and stats.regions == 3
    assert stats.activation_peak_bytes <= stats.activation_budget_bytes
    raised = stats.activation_budget_bytes > stats.requested_activation_budget_bytes
    if raised:  # even recomputing every region does not fit: the base plan, reported as such
        assert stats.regions_recomputed == 3
    for graph, persistent in ((fw.graph, 0), (bw.graph, kept.nbytes)):
        total, gather_raised = _total_profile(graph, memory, persistent, opts)
        if not (raised or gather_raised):
            assert int(total.max()) <= memory, (int(total.max()), memory, stats)


def test_the_split_follows_the_budget(joint):
    """Recompute everything at the smallest budget, nothing at the largest, and in between
    something in between, with kept bytes and recomputed FLOPs moving opposite ways."""

    def at(budget):
        opts = CompileOptions(recompute="auto", inner="aot_eager", activation_budget_bytes=budget)
        return _partition(joint, opts)[3]

    nothing, everything = at(1), at(1 << 40)
    # Halfway between the peak recomputing everything and the peak keeping everything.
    middle = at((nothing.activation_budget_bytes + everything.activation_peak_bytes) // 2)
    assert nothing.regions_recomputed == 3 and nothing.recomputed_flops > 0
    assert everything.regions_kept == 3 and everything.recomputed_flops == 0
    assert nothing.kept_bytes < middle.kept_bytes < everything.kept_bytes
    # "selective" keeps every matmul output: the middle may recompute no FLOPs, but recomputes
    # more bytes (the pointwise ops) than keeping everything.
    assert nothing.recomputed_flops > middle.recomputed_flops >= everything.recomputed_flops
    assert nothing.recomputed_bytes > middle.recomputed_bytes > everything.recomputed_bytes
    assert middle.regions_kept < 3
    for s in (nothing, middle, everything):
        assert s.activation_peak_bytes <= s.activation_budget_bytes


def test_modes_on_a_compiled_model_and_their_records():
    """checkpointed recomputes the regions as written, none keeps them; both records say what
    was kept and recomputed; "auto" without candidate regions has nothing to decide."""
    from zbuf.models import build_model, loss, resolve_config
    from zbuf.shard import shard

    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    seen = {}
    for mode, ac in (("checkpointed", True), ("none", True), ("auto", False)):
        torch._dynamo.reset()
        clear_records()
        model = shard(_decoder(2) if ac else build_model(resolve_config("tiny").replace(
            num_layers=2, vocab_size=97)))
        cm = torch.compile(model, backend="zbuf", fullgraph=True,
                           options={"inner": "aot_eager", "recompute": mode})
        loss(cm, tokens, tokens).backward()
        recs = schedule_report(model)
        assert [r.kind for r in recs] == ["forward", "backward"]
        assert recs[0].recompute == recs[1].recompute
        seen[mode] = recs[0].recompute
    assert seen["checkpointed"].regions == 2 == seen["checkpointed"].regions_recomputed
    assert seen["checkpointed"].recomputed_flops > 0
    assert seen["none"].regions_kept == 2 and seen["none"].recomputed_flops == 0
    assert seen["none"].kept_bytes > seen["checkpointed"].kept_bytes
    assert seen["auto"].regions == 0 and seen["auto"].partitions == 1
    for s in seen.values():
        assert s.forward_flops > 0 and s.activation_peak_bytes > 0


def test_recompute_options_are_validated():
    with pytest.raises(ValueError, match="recompute='sometimes' must be one of"):
        CompileOptions(recompute="sometimes")
    with pytest.raises(ValueError, match="activation_budget_bytes is the budget of recompute='auto'"):
        CompileOptions(activation_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="activation_budget_bytes=0 must be a positive int"):
        CompileOptions(recompute="auto", activation_budget_bytes=0)


def test_activation_profile_keeps_a_base_alive_through_its_views_and_counts_views_once():
    """A matmul's output reshaped by ``_unsafe_view`` (as matmul decompositions do) is one
    tensor, not two: the peak is not doubled; and a base stays alive while a view of it is read
    (the base's last direct reader is not the end of its storage)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, c):
        logits = torch.matmul(a, b)          # view -> mm -> _unsafe_view: one [2, 8, 64] tensor
        flat = logits.view(-1)               # a view, read below after other work
        other = c * 2                        # 4 KiB
        return (flat * 3).sum() + other.sum()

    a, b, c = torch.randn(2, 8, 16), torch.randn(16, 64), torch.randn(1024)
    gm = make_fx(f, tracing_mode="fake")(a, b, c)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten._unsafe_view.default in targets
    profile = activation_profile(gm.graph)
    inputs = sum(t.numel() * 4 for t in (a, b, c))
    logits, other = 2 * 8 * 64 * 4, 1024 * 4
    times3 = next(i for i, n in enumerate(gm.graph.nodes)
                  if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 3)
    # While `flat * 3` runs: the matmul output (read through two views), its product, `other`.
    assert profile[times3] == 2 * logits + other
    assert int(profile.max()) <= inputs + 2 * logits + other  # never the logits twice at once


def test_identical_blocks_get_identical_levels_on_any_copy_of_the_graph(joint):
    """Every rank plans recompute alone, so equal blocks must cost exactly the same (to the last
    bit: the planner breaks ties between equal rates by position) however the graph's nodes lie
    in memory. Ranks that tied differently compiled different graphs and failed the cross-rank
    schedule check."""
    opts = CompileOptions(recompute="auto", inner="aot_eager")
    outputs = joint["kwargs"]["num_fwd_outputs"]

    def specs(gm):
        forward = recompute.forward_nodes(gm.graph, outputs)
        regions = recompute.find_regions(gm.graph, forward)
        return [spec.levels for spec in recompute.level_specs(gm.graph, forward, regions, opts)]

    first = specs(joint["gm"])
    assert len(first) == 3 and first[0] == first[1] == first[2], first
    assert first[0][0].recompute_seconds > 0
    for _ in range(5):  # new nodes at new addresses: another iteration order of any node set
        assert specs(recompute.copy_joint(joint["gm"])) == first


def test_a_forward_ops_results_are_forward_values():
    """``forward_nodes``: every item of a forward op with several results is a forward value,
    also one only backward reads (attention's log-sum-exp outside any checkpointed region): it
    is computed with its op, so a block's region and the partition's estimates count it where
    it is made."""
    from zbuf.compile.graph_info import unpacks_results

    joint = _joint_of(_decoder(checkpointed=False))
    gm = joint["gm"]
    forward = recompute.forward_nodes(gm.graph, joint["kwargs"]["num_fwd_outputs"])
    backward = recompute.backward_nodes(gm.graph)
    items = [u for n in forward for u in n.users if unpacks_results(u) and u not in backward]
    attention = [u for u in items if "attention" in str(u.args[0].target)]
    assert attention and all(u in forward for u in items)
    # Some of those items are read by backward alone (the op's second result).
    assert any(all(r in backward for r in u.users) for u in attention)
