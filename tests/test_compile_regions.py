"""Compiling repeated blocks once (``CompileOptions.compile_blocks_once``, compile/regions.py), one
process: the block body is traced into one subgraph, partitioned and lowered once, the gathers
stay in the outer graphs where the planner sees them, and training matches eager zbuf and the
unsharded reference. Two and three ranks: test_compile_dist.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import zbuf.compile
from zbuf.compile import region_graphs, schedule_report
from zbuf.compile.passes import GatherSchedulePass
from zbuf.models import apply_activation_checkpointing, build_model, resolve_config
from zbuf.shard import shard
from zbuf.state_dict import full_state_dict
from parity import rel_err, tiny_qwen3, token_batches, train_adamw

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

REGION = torch.ops.higher_order.invoke_subgraph
LAYERS = 3


def _capture(monkeypatch):
    """The outer forward/backward graphs as the schedule pass leaves them, and the region bodies
    whose joint graph the partitioner saw."""
    graphs, bodies = [], []
    plan = GatherSchedulePass.plan_and_rewrite

    def keep(self, graph):
        plan(self, graph)
        if not region_graphs.is_body(graph):
            graphs.append(graph)

    prepare = region_graphs.prepare_body_joint

    def seen(joint, options):
        bodies.append(joint)
        prepare(joint, options)

    monkeypatch.setattr(GatherSchedulePass, "plan_and_rewrite", keep)
    monkeypatch.setattr(region_graphs, "prepare_body_joint", seen)
    import zbuf.compile.passes as passes
    monkeypatch.setattr(passes, "prepare_body_joint", seen)
    return graphs, bodies


def _decoder(ac: bool):
    cfg = resolve_config("tiny").replace(num_layers=LAYERS, vocab_size=97)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, ac)
    return init


def _zbuf_ops(graph, name):
    return [n for n in graph.nodes if getattr(n.target, "_schema", None) is not None
            and n.target._schema.name == f"zbuf::{name}"]


def _released(graph) -> list:
    """The buffers the graph's releases take (each once: a buffer released twice counts twice)."""
    return [b for n in _zbuf_ops(graph, "all_gather_release") for b in n.all_input_nodes
            if b.target is torch.ops.zbuf.gather_buffer.default]


@pytest.mark.parametrize("ac,persist", [(False, False), (True, False), (False, True)])
def test_blocks_compile_once_and_train_like_eager(monkeypatch, ac, persist):
    graphs, bodies = _capture(monkeypatch)
    init = _decoder(ac)
    batches = token_batches()
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, batches)
    eager = shard(copy.deepcopy(init))
    eager_losses = train_adamw(eager, eager, batches)
    model = shard(copy.deepcopy(init))
    # An explicit budget: one plan for every step (no measured step to grow from), so the
    # graphs captured are that plan's.
    cm = zbuf.compile(model, inner="aot_eager", persist=persist, compile_blocks_once=True,
                      fullgraph=True, budget_bytes=1 << 30)
    losses = train_adamw(cm, model, batches)

    # aot_eager runs eager kernels: the same numbers as eager zbuf, and the reference's to 1e-5.
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    worst = max(rel_err(full[k], ref_sd[k]) for k in ref_sd)
    assert worst <= 1e-5, worst

    # One body for all blocks: partitioned once, called once per block from each outer graph.
    assert len(bodies) == 1
    fw, bw = graphs
    for g in (fw, bw):
        calls = [n for n in g.nodes if n.target is REGION]
        assert len(calls) == LAYERS
        assert len({n.args[1] for n in calls}) == 1
    # The gathers are the outer graphs' (the bodies hold none): every block parameter is gathered
    # in forward, and, without persistence, gathered again in backward rather than kept.
    block_params = sum(1 for _ in model.layers.parameters())
    fw_rec, bw_rec = schedule_report(model)
    assert fw_rec.gathers >= block_params
    if persist:
        assert fw_rec.persistent > 0
    else:
        assert fw_rec.persistent == 0 and bw_rec.gathers >= block_params
        # Nothing gathered leaves the forward graph: every buffer is released there.
        assert sorted(map(str, _released(fw))) == sorted(map(str, _zbuf_ops(fw, "gather_buffer")))
    for rec in (fw_rec, bw_rec):
        assert rec.peak_live_gathered_bytes <= rec.budget_bytes
    # Forward FLOPs count the block calls' bodies: at least 2 per token per weight of every
    # matrix forward multiplies by (the blocks' and the output head's). Counted as 0, the block
    # calls left only the head's (issue 37).
    tokens = sum(b[:, :-1].numel() for b in batches[:1])
    matrices = sum(p.numel() for p in init.layers.parameters() if p.dim() == 2) + \
        init.embed_tokens.weight.numel()
    assert fw_rec.recompute.forward_flops >= 2 * tokens * matrices, fw_rec.recompute



def _train_small_decoder(layers: int, ac) -> None:
    """One training step of a small sharded decoder, its blocks compiled once."""
    cfg = resolve_config("tiny").replace(num_layers=layers, vocab_size=97, hidden_size=64,
                                         ffn_hidden_size=128, head_dim=16)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, ac)
    model = shard(init)
    cm = zbuf.compile(model, inner="aot_eager", fullgraph=True, budget_bytes=1 << 30,
                      compile_blocks_once=True)
    train_adamw(cm, model, token_batches(1))

@pytest.mark.parametrize("ac", [False, True])
def test_compile_work_does_not_grow_with_identical_blocks(monkeypatch, ac):
    """Issue 21: from 2 to 8 identical blocks, the model compiles as many Dynamo graphs, traces,
    partitions and installs as many block bodies, and none of them more than once per distinct
    body; only the outer graphs' calls grow. Up to 0dadfdf's parent torch's schema check re-traced
    the body at every call ([Note: one schema per region]): 10 body traces at 2 blocks, 40 at 8;
    3 at any depth up to 845ca7f (the forward body again under the autograd function's identifier,
    and the backward body, which the schema now reads off its aten graph): 1 now."""
    import torch._higher_order_ops.utils as hop_utils
    from torch._dynamo.utils import compilation_time_metrics, counters

    from zbuf.compile.report import clear_records

    traced = []
    materialize = hop_utils.materialize_as_graph

    def counting(*args, **kwargs):
        traced.append(1)
        return materialize(*args, **kwargs)

    monkeypatch.setattr(hop_utils, "materialize_as_graph", counting)
    graphs, bodies = _capture(monkeypatch)
    work = {}
    for layers in (2, 8):
        torch._dynamo.reset()
        clear_records()
        traced.clear()
        graphs.clear()
        bodies.clear()
        spans0 = len(compilation_time_metrics.get("invoke_subgraph_proxy_tensor", []))
        graphs0 = counters["stats"]["unique_graphs"]
        _train_small_decoder(layers, ac)
        calls = [n for g in graphs for n in g.nodes if n.target is REGION]
        assert len(calls) == 2 * layers  # one forward and one backward call per block
        work[layers] = dict(
            dynamo_graphs=counters["stats"]["unique_graphs"] - graphs0,
            bodies_partitioned=len(bodies),
            bodies_installed=len({n.args[0].target for n in calls}),
            body_proxy_traces=len(compilation_time_metrics["invoke_subgraph_proxy_tensor"])
            - spans0,
            body_schema_traces=len(traced))
    assert work[2] == work[8], work
    assert work[8]["bodies_partitioned"] == 1 and work[8]["bodies_installed"] == 2, work
    assert work[8]["body_schema_traces"] == 1, work


def test_one_release_per_block_call(monkeypatch):
    """Issue 21: Inductor lowers every zbuf op of the outer graphs on its own (a fallback kernel
    each, the release the costliest: 4.4 ms on CPU), so their number is what the outer graphs'
    compile grows by. Every weight of a block is released at one slot, after the block call:
    one release op takes them all ([Note: one release per slot] in rewrite.py). Up to d7ea1b9
    one release per weight: 11 per block here, 24 in each outer graph at 2 blocks, 90 at 8."""
    graphs, _ = _capture(monkeypatch)
    counts = {}
    for layers in (2, 8):
        torch._dynamo.reset()
        graphs.clear()
        _train_small_decoder(layers, False)
        fw, bw = graphs
        counts[layers] = [(len(_zbuf_ops(g, "all_gather_release")), len(_released(g)),
                           len(_zbuf_ops(g, "gather_buffer"))) for g in (fw, bw)]
    for layers, per_graph in counts.items():
        for ops, released, buffers in per_graph:
            assert released == buffers, counts  # every buffer released, once
            assert ops <= layers + 2, counts  # one per block call, and the embedding and head
    assert counts[8][0][2] - counts[2][0][2] >= 6 * 8, counts  # while the buffers grow per weight


@pytest.mark.parametrize("ac", [False, True])
def test_schema_read_off_a_body_is_torchs(monkeypatch, ac):
    """Where [Note: one schema per region] reads a body's schema off its aten graph instead of
    letting torch re-trace it, the schema is the one torch's ``gen_schema`` gives: checked at
    every such call while the decoder compiles (a torch whose ``gen_schema`` changes fails here)."""
    from zbuf.compile import region_schema

    read_off = region_schema.schema_of_aten_graph
    pairs = []

    def both(body, identifier, *operands):
        schema = read_off(body, identifier, *operands)
        if schema is not None:
            traced = type(REGION).gen_schema(REGION, body, identifier, *operands)
            pairs.append((str(schema), str(traced)))
        return schema

    monkeypatch.setattr(region_schema, "schema_of_aten_graph", both)
    _train_small_decoder(2, ac)
    assert pairs  # the backward body's
    for ours, torchs in pairs:
        assert ours == torchs


@pytest.mark.parametrize("options,regions", [
    ({}, False),  # the default: off ([Note: region bodies], step 0)
    ({"compile_blocks_once": True}, True),
    ({"recompute": "auto"}, False),  # auto plans over the whole graph's checkpointed regions
])
def test_when_blocks_compile_once(monkeypatch, options, regions):
    graphs, bodies = _capture(monkeypatch)
    model = shard(_decoder(False))
    cm = zbuf.compile(model, inner="aot_eager", fullgraph=True, **options)
    train_adamw(cm, model, token_batches(1))
    assert bool(bodies) == regions
    assert all(any(n.target is REGION for n in g.nodes) == regions for g in graphs)


def test_blocks_once_with_auto_recompute_is_refused():
    with pytest.raises(ValueError, match="does not combine with recompute='auto'"):
        zbuf.compile.CompileOptions(compile_blocks_once=True, recompute="auto")


def test_repeated_blocks_are_found():
    model = shard(_decoder(False))
    assert [len(s) for s in zbuf.compile.regions.repeated_blocks(model)] == [LAYERS]
    assert zbuf.compile.mark_repeated_blocks(model) == LAYERS
    assert zbuf.compile.mark_repeated_blocks(model) == LAYERS  # idempotent
    # Marking changes neither the eager results nor the state dict.
    assert list(model.state_dict()) == list(shard(_decoder(False)).state_dict())
    unmarked = shard(_decoder(False))
    tokens = token_batches(1)[0]
    torch.testing.assert_close(model(tokens), unmarked(tokens), rtol=0, atol=0)
    assert zbuf.compile.regions.repeated_blocks(shard(nn.Sequential(nn.Linear(4, 4)))) == []


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def test_one_region_class_per_block_class_kept_on_it():
    # Two models' blocks of one class share one marked class (Dynamo sees one type per stack),
    # kept on the block class itself; a subclass of the block class gets its own.
    class Sub(_Block):
        pass

    models = [shard(nn.Sequential(nn.ModuleList([kind(), kind()]))) for kind in (_Block, _Block, Sub)]
    for m in models:
        assert zbuf.compile.mark_repeated_blocks(m) == 2
    kinds = [{type(b) for b in m[0]} for m in models]
    assert kinds[0] == kinds[1] == {_Block.__dict__["_zbuf_region_class"]}
    assert kinds[2] == {Sub.__dict__["_zbuf_region_class"]} != kinds[0]
    zbuf.compile.regions.unmark_repeated_blocks(models[2])
    assert {type(b) for b in models[2][0]} == {Sub}


def test_gathers_inside_a_users_region_are_refused():
    """A region the user marks around code that reads sharded parameters would hide its gathers
    from the plan; the error says what to do instead."""
    blocks = shard(nn.ModuleList(_Block() for _ in range(2)))
    body = torch.compiler.nested_compile_region(lambda b, x: b(x))

    def f(x):
        for b in blocks:
            x = body(b, x)
        return x.sum()

    cf = torch.compile(f, backend="zbuf", options={"inner": "aot_eager"}, fullgraph=True)
    with pytest.raises(Exception, match="gathers sharded parameters inside its body"):
        cf(torch.randn(3, 8, requires_grad=True)).backward()


@pytest.mark.parametrize("ac", [False, True])
def test_hugging_face_layers_compile_once(monkeypatch, ac):
    """Hugging Face checkpoints in the layer's ``__call__``, around ``forward``: marking wraps
    ``__call__``, so the checkpoint is inside the region body too."""
    pytest.importorskip("transformers")
    graphs, bodies = _capture(monkeypatch)
    init = tiny_qwen3(checkpointed=ac, layers=LAYERS)
    batches = token_batches(2)

    def run(fn, model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for tokens in batches:
            lo = fn(input_ids=tokens, labels=tokens).loss
            lo.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(lo.item())
        return out

    ref = copy.deepcopy(init)
    ref_losses = run(ref, ref)
    model = shard(copy.deepcopy(init))
    cm = zbuf.compile(model, inner="aot_eager", compile_blocks_once=True, budget_bytes=1 << 30)
    losses = run(cm, model)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    assert len(bodies) == 1
    assert sum(n.target is REGION for n in graphs[0].nodes) == LAYERS


@pytest.mark.skipif(os.environ.get("ZBUF_TEST_INDUCTOR", "0") != "1",
                    reason="minutes of C++ compilation on 2 cores: set ZBUF_TEST_INDUCTOR=1")
def test_inductor_lowers_the_body_once():
    from torch._dynamo.utils import compilation_time_metrics

    init = _decoder(True)
    batches = token_batches(2)
    eager = shard(copy.deepcopy(init))
    eager_losses = train_adamw(eager, eager, batches)
    model = shard(copy.deepcopy(init))
    cm = zbuf.compile(model, inner="inductor", persist=False, compile_blocks_once=True,
                      fullgraph=True)
    before = len(compilation_time_metrics.get("GraphLowering.run", []))
    losses = train_adamw(cm, model, batches)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    # Outer forward and backward, and the body's forward and backward: 4 lowerings, not 2 + 2N.
    assert len(compilation_time_metrics["GraphLowering.run"]) - before == 4
