"""One Dynamo frame per repeated block (``zbuf.compile(..., structure="blocks")``,
compile/block_frames.py), one process: the compile work does not grow with the number of
identical blocks, at most two blocks' gathered weights are live, training matches eager zbuf and
the unsharded reference, and what the structure does not take is refused with one clear error.
Two and three ranks: test_block_frames_dist.py.
"""

from __future__ import annotations

import collections
import copy
import weakref

import pytest
import torch
from torch import nn

import zbuf.compile
from zbuf.compile import block_frames
from zbuf.compile.block_frames import NoRepeatedBlocksError, block_frames_of
from zbuf.pool import GatherBufferPool
from zbuf.models import apply_activation_checkpointing, build_model, loss, resolve_config
from zbuf.shard import op_counts, root_of, shard
from zbuf.state_dict import full_state_dict
from parity import hf_loss, rel_err, tiny_qwen3, token_batches, train_adamw

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py


def _decoder(layers: int, ac):
    cfg = resolve_config("tiny").replace(num_layers=layers, vocab_size=97, hidden_size=64,
                                         ffn_hidden_size=128, head_dim=16)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, ac)
    return init


def _frames(model, **options):
    return zbuf.compile(model, inner="aot_eager", structure="blocks", fullgraph=True, **options)


@pytest.mark.parametrize("recompute", ["checkpointed", "none"])
def test_compile_work_does_not_grow_with_identical_blocks(monkeypatch, recompute):
    """Issue 21: from 2 to 8 identical blocks, Dynamo traces as many frames and captures as many
    graphs, the frames' backend gets as many graphs and AOTAutograd partitions as many joint
    graphs: one each. No gather is in the frame's graph (the weights are its inputs)."""
    from torch._dynamo.utils import counters

    joints, backward_mms = [], []
    partition = block_frames.FramePartitioner.__call__

    def seen(self, gm, joint_inputs, **kwargs):
        joints.append(gm)
        fw, bw = partition(self, gm, joint_inputs, **kwargs)
        backward_mms.append(sum(n.target is torch.ops.aten.mm.default for n in bw.graph.nodes))
        return fw, bw

    monkeypatch.setattr(block_frames.FramePartitioner, "__call__", seen)
    work = {}
    for layers in (2, 8):
        torch._dynamo.reset()
        counters.clear()
        joints.clear()
        model = shard(_decoder(layers, True))
        _frames(model, recompute=recompute)
        train_adamw(model, model, token_batches(2))
        work[layers] = dict(
            frames=counters["stats"]["unique_graphs"],
            captured=counters["stats"]["calls_captured"],
            backend_graphs=block_frames_of(model).graphs_compiled,
            partitioned=len(joints),
            recompiles=sum(counters["recompiles"].values()))
        for joint in joints:
            assert not [n for n in joint.graph.nodes if str(n.target).startswith("zbuf.")]
    assert work[2] == work[8], work
    assert work[8]["frames"] == 1 and work[8]["backend_graphs"] == 1, work
    assert work[8]["recompiles"] == 0, work
    # The blocks are checkpointed: "none" keeps the projections' outputs (the backward's matmuls
    # are the 14 gradient ones), "checkpointed" recomputes those the backward reads (20 here).
    assert (backward_mms[-1] > 14) if recompute == "checkpointed" else (backward_mms[-1] == 14), \
        backward_mms


@pytest.mark.parametrize("ac,recompute", [(False, "checkpointed"), (True, "checkpointed"),
                                          (True, "none")])
def test_frames_train_like_eager_and_the_reference(ac, recompute):
    init = _decoder(3, ac)
    batches = token_batches()
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, batches)
    eager = shard(copy.deepcopy(init))
    eager_losses = train_adamw(eager, eager, batches)
    model = shard(copy.deepcopy(init))
    cm = _frames(model, recompute=recompute)
    assert cm is model  # the model itself, its blocks swapped in place
    losses = train_adamw(cm, model, batches)
    # aot_eager runs eager kernels: eager zbuf's numbers, and the reference's to 1e-5.
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    assert list(full) == list(ref_sd)
    worst = max(rel_err(full[k], ref_sd[k]) for k in ref_sd)
    assert worst <= 1e-5, worst
    # Nothing is left behind: every gathered buffer is back in the pool, no use is open.
    root = root_of(model)
    assert root.pool.stats().checked_out == 0
    assert root.reduce_once.open_uses() == 0 and root.reduce_once.open_accumulators() == 0


def _live_gathered_peak(pool, run) -> int:
    """The most gathered bytes (padded buffers as requested) alive at once while ``run()`` runs:
    a buffer is alive while it or any view of it is (a view keeps its base). Checked after every
    acquire: only an acquire makes it grow. (The pool's own ``checked_out_bytes`` counts the
    capacity of the block that served a request, which on a first step may be a larger idle
    block.)"""
    acquire, peak, live = pool.acquire, [0], [0]

    def counting(*args, **kwargs):
        t = acquire(*args, **kwargs)
        live[0] += t.nbytes
        weakref.finalize(t, lambda n=t.nbytes: live.__setitem__(0, live[0] - n))
        peak[0] = max(peak[0], live[0])
        return t

    pool.acquire = counting
    try:
        run()
    finally:
        pool.acquire = acquire
    return peak[0]


@pytest.mark.parametrize("recompute", ["checkpointed", "none"])
def test_at_most_two_blocks_live(recompute):
    """[Note: two blocks live]: prefetch one block ahead holds two blocks' weights, in forward
    and backward, however deep the stack; without prefetch one. Every block is gathered once in
    forward and once again for backward (nothing saved keeps it)."""
    peaks, outside = {}, {}
    for layers, prefetch in ((2, True), (8, True), (8, False)):
        torch._dynamo.reset()
        # A pool of its own: the high-water marks are this model's.
        model = shard(_decoder(layers, recompute == "checkpointed"), pool=GatherBufferPool())
        frames = block_frames.install_block_frames(
            model, zbuf.compile.CompileOptions(inner="aot_eager", prefetch=prefetch,
                                               recompute=recompute), fullgraph=True)
        pool = root_of(model).pool
        plan = frames.plan
        assert plan.prefetch == prefetch
        block_params = sum(1 for _ in model.layers[0].parameters())
        before = op_counts(model)["all_gather"]
        peaks[layers, prefetch] = _live_gathered_peak(pool, lambda: train_adamw(model, model,
                                                                           token_batches(1)))
        outside[layers, prefetch] = (op_counts(model)["all_gather"] - before
                                     - 2 * layers * block_params)
        assert peaks[layers, prefetch] <= plan.live_bytes, (peaks, plan)
        stats = pool.stats()
        assert stats.budget_bytes == plan.pool_bytes
        assert stats.outside_allocations == 0 and stats.high_water_total_bytes <= plan.pool_bytes
        assert stats.checked_out == 0
        # After the first step every gather finds its block cached: the pool sized for the plan.
        train_adamw(model, model, token_batches(1))
        assert pool.stats().misses == stats.misses
    # The gathers outside the blocks (embedding, norm, head and their re-gathers) do not grow.
    assert len(set(outside.values())) == 1 and outside[2, True] > 0, outside
    block = block_frames.frame_slot_of(model.layers[0]).weights.gathered_nbytes
    assert peaks[2, True] == peaks[8, True] == 2 * block, (peaks, block)
    assert peaks[8, False] == block, (peaks, block)


def test_prefetch_off_when_two_blocks_do_not_fit():
    model = shard(_decoder(2, False))
    weights = block_frames_of(model)
    assert weights is None
    frames = block_frames.install_block_frames(
        model, zbuf.compile.CompileOptions(inner="aot_eager", budget_bytes=200_000))
    assert frames.plan.block_bytes <= 200_000 < 2 * frames.plan.block_bytes
    assert not frames.plan.prefetch
    # An explicit budget below one block's weights plans with them, as the whole graph's planner
    # raises a budget below its floor, and the schedule says so (the CLI's notice reads it).
    raised = block_frames.install_block_frames(
        shard(_decoder(2, False)), zbuf.compile.CompileOptions(inner="aot_eager", budget_bytes=1000))
    schedule = raised.schedule()
    assert schedule["requested_budget_bytes"] == 1000
    assert schedule["budget_bytes"] == raised.plan.block_bytes + raised.plan.outer_bytes
    # The agreed memory is what the card has: below one block, the frames are refused.
    with pytest.raises(zbuf.compile.PlanExceedsMemoryError, match="structure='blocks' needs"):
        block_frames.install_block_frames(
            shard(_decoder(2, False)),
            zbuf.compile.CompileOptions(inner="aot_eager", free_memory_bytes=1000))


def test_eval_forward_under_no_grad():
    init = _decoder(3, True)
    model = shard(copy.deepcopy(init))
    _frames(model)
    tokens = token_batches(1)[0]
    with torch.no_grad():
        got = model(tokens)
        want = init(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert root_of(model).pool.stats().checked_out == 0


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def test_repeated_stacks_are_found_and_one_frame_class_serves_each_block_class():
    """The stacks zbuf.compile picks the block structure for: an ``nn.ModuleList`` of two or more
    sharded modules of one class. Two models' blocks of one class share one frame class (Dynamo
    sees one type per stack), kept on the block class itself; a subclass gets its own."""
    from zbuf.compile.block_stacks import base_class, repeated_blocks

    assert [len(s) for s in repeated_blocks(shard(_decoder(3, False)))] == [3]
    assert repeated_blocks(shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))) == []
    assert repeated_blocks(nn.ModuleList([_Block(), _Block()])) == []  # not sharded

    class Sub(_Block):
        pass

    models = [shard(nn.Sequential(nn.ModuleList([kind(), kind()]))) for kind in (_Block, _Block, Sub)]
    for m in models:
        _frames(m)
    kinds = [{type(b) for b in m[0]} for m in models]
    assert kinds[0] == kinds[1] and len(kinds[0]) == 1 and kinds[2] != kinds[0]
    assert [{base_class(b) for b in m[0]} for m in models] == [{_Block}, {_Block}, {Sub}]
    # A stack already running as frames is still found, by its blocks' own class.
    assert [len(s) for s in repeated_blocks(models[0])] == [2]


def test_bad_inputs_get_one_clear_error():
    with pytest.raises(NoRepeatedBlocksError, match="found no repeated blocks in Sequential.*"
                                                    "use structure='graph'"):
        _frames(shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))))
    with pytest.raises(ValueError, match="recompute='auto' plans the blocks' levels in the room "
                                         "the first step measures.*drop budget_bytes"):
        _frames(shard(_decoder(2, True)), recompute="auto", budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="does not take activation_budget_bytes.*leave it unset"):
        _frames(shard(_decoder(2, True)), recompute="auto", activation_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="structure='bogus' must be one of 'graph', 'blocks'"):
        zbuf.compile.CompileOptions(structure="bogus")
    with pytest.raises(ValueError, match="needs a model sharded with zbuf.shard"):
        _frames(nn.ModuleList([_Block(), _Block()]))


def test_blocks_called_out_of_order_still_match():
    """A prefetched gather for a block that does not come next is finished and dropped; the
    block that does come gathers on demand (the order stays the program's)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3))
    ref = copy.deepcopy(blocks)
    model = shard(copy.deepcopy(blocks))
    _frames(model)
    x = torch.randn(4, 8)
    order = (2, 0, 1, 1)

    def run(m):
        h = x
        for i in order:
            h = m[i](h)
        return h.square().sum()

    run(model).backward()
    run(ref).backward()
    shards = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        grad = shards[name].grad  # one rank: the whole gradient, flat
        torch.testing.assert_close(grad[: p.numel()].view(p.shape), p.grad)
    # The last call (block 1) prefetched block 2, which did not come: held until the model's
    # forward ends (a ModuleList has none here), then finished and dropped.
    pool = root_of(model).pool
    assert pool.stats().checked_out == 2  # block 2's weight and bias
    block_frames_of(model).prefetch.finish_forward()
    assert pool.stats().checked_out == 0


def test_step_memory_measures_the_step():
    """``zbuf.compile(..., optimizer=opt)`` attaches the whole step's measured memory, which
    keeps measuring under block frames. With the user's checkpointing and one rank its
    re-planner changes nothing: no levels to plan, no weights worth keeping (nothing is
    gathered from other ranks)."""
    from zbuf.compile import step_memory_of

    model = shard(_decoder(2, True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", fullgraph=True, optimizer=opt)
    memory = step_memory_of(cm)
    assert memory is not None and memory.replanner is not None
    for tokens in token_batches(3):
        loss(cm, tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(memory.rows) >= 2 and memory.measured is not None
    assert not memory.measured.replanned
    # The levels in force, reported: every block at the user's checkpointing (the CPU has no
    # host link to offload over).
    recompute = memory.measured.recompute
    assert recompute["mode"] == "checkpointed" and recompute["regions_offloaded"] == 0
    assert recompute["regions_recomputed"] == recompute["regions"] == 2
    assert root_of(model).pool.stats().budget_bytes == block_frames_of(model).plan.pool_bytes


def test_train_config_takes_the_structure():
    from zbuf.train.config import ConfigError, TrainConfig

    cfg = TrainConfig(compile_structure="blocks").resolve(cuda=False, world=2, bench=False)
    assert cfg.compile_structure == "blocks"
    auto = TrainConfig(compile_structure="blocks", ac="auto").resolve(cuda=False, world=2,
                                                                      bench=False)
    assert auto.ac == "auto"
    with pytest.raises(ConfigError, match="--compile-structure blocks with --ac auto .* "
                                          "drop --gather-budget"):
        TrainConfig(compile_structure="blocks", ac="auto", gather_budget=1 << 30).resolve(
            cuda=False, world=2, bench=False)


@pytest.mark.parametrize("ac", [False, True])
def test_hugging_face_layers_run_as_frames(ac):
    """Hugging Face checkpoints in the layer's ``__call__``: the frame runs ``__call__``, so the
    checkpoint is inside it. One frame graph for the stack, losses as the reference's."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    init = tiny_qwen3(checkpointed=ac)
    batches = token_batches(2)

    def run(fn, model):
        return train_adamw(fn, model, batches, loss_of=hf_loss)

    ref = copy.deepcopy(init)
    ref_losses = run(ref, ref)
    model = shard(copy.deepcopy(init))
    counters.clear()
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks")
    losses = run(cm, model)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    assert block_frames_of(model).graphs_compiled == 1
    assert counters["stats"]["unique_graphs"] == 1


class _TiedFrozenBlock(nn.Module):
    """A block with a weight used twice (one parameter under two names) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return x + torch.tanh(self.b(torch.relu(self.a(x)))) + self.frozen(x)


def test_tied_and_frozen_weights_inside_blocks():
    """A tied weight is gathered once per block call and reduce-scattered once; a frozen one is
    gathered and never reduced; backward re-gathers only what the frame saved. Gradients as the
    reference's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.ModuleList(_TiedFrozenBlock() for _ in range(3)))
    model = shard(copy.deepcopy(ref))

    class Run(nn.Module):
        def __init__(self, stack):
            super().__init__()
            self.stack = stack

        def forward(self, x):
            for block in self.stack[0]:
                x = block(x)
            return x.square().mean()

    runner = Run(model)
    _frames(runner)
    x = torch.randn(5, 8)
    before = op_counts(model).copy()
    runner(x).backward()
    Run(ref)(x).backward()
    counts = op_counts(model)
    # Forward: the tied weight once, the frozen weight and bias. Backward: what the frames saved,
    # the tied weight, and the frozen weight where the block's input needs a gradient (not the
    # first block's: x does not); never the bias, which no gradient reads.
    assert counts["all_gather"] - before["all_gather"] == 3 * 3 + (1 + 2 + 2)
    assert counts["reduce_scatter"] - before["reduce_scatter"] == 3  # the tied weight, once each
    shards = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(shards[name].grad[: p.numel()].view(p.shape), p.grad)
        else:
            assert shards[name].grad is None


def test_each_model_compiles_its_own_frame():
    """Dynamo's cache lives on the code object; each model's frames run their own copy of it, so
    a second model (here with another recompute mode) neither reuses the first's graph nor
    spends its recompiles."""
    models = []
    for recompute in ("checkpointed", "none"):
        model = shard(_decoder(2, True))
        _frames(model, recompute=recompute)
        train_adamw(model, model, token_batches(1))
        models.append(model)
    assert [block_frames_of(m).graphs_compiled for m in models] == [1, 1]
    first, second = (block_frames_of(m).frame for m in models)
    assert first is not second


def test_two_forwards_then_one_backward():
    """Two micro-batches' forwards, then one backward of their summed losses: each forward's
    saved blocks re-gather on their own, every gradient as the reference's."""
    init = _decoder(3, True)
    ref = copy.deepcopy(init)
    model = shard(copy.deepcopy(init))
    _frames(model)
    first, second = token_batches(2)
    for m in (model, ref):
        total = loss(m, first[:, :-1], first[:, 1:]) + loss(m, second[:, :-1], second[:, 1:])
        total.backward()
    shards = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(shards[name].grad[: p.numel()].view(p.shape), p.grad,
                                   rtol=1e-5, atol=1e-7)
    assert root_of(model).pool.stats().checked_out == 0


def _matmuls_and_attention(run) -> collections.Counter:
    """The matmul and attention kernels ``run()`` executes, counted by the profiler (which sees
    aot_eager's aten calls inside compiled graphs without changing what Dynamo runs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return collections.Counter(e.name for e in prof.events()
                               if e.name in ("aten::mm", "aten::addmm", "aten::bmm")
                               or "scaled_dot_product" in e.name)


def test_blocks_do_the_whole_graphs_work():
    """Issue 21: the block structure computes no more than the whole graph, step for step: the
    same matmuls and attention in forward, and in backward no more recomputed (the whole graph's
    partition recomputes one projection more, which the frame's partition saves), under the
    user's checkpointing. A step-time difference between the
    structures is then in how the kernels run, not in how many (the qwen3-14b gap of
    benches/results/seed14_blocks.md)."""
    init = _decoder(2, True)
    counts = {}
    for structure in ("graph", "blocks"):
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init))
        cm = zbuf.compile(model, inner="aot_eager", structure=structure, recompute="checkpointed")
        for tokens in token_batches(2):  # counted: the second step, compiled by the first
            out = []
            forward = _matmuls_and_attention(
                lambda: out.append(loss(cm, tokens[:, :-1], tokens[:, 1:])))
            backward = _matmuls_and_attention(out[0].backward)
            model.zero_grad(set_to_none=True)
        counts[structure] = (forward, backward)
    (forward, backward), (graph_forward, graph_backward) = counts["blocks"], counts["graph"]
    assert forward == graph_forward, counts
    assert graph_backward - backward == collections.Counter({"aten::mm": 1}), counts
    assert not backward - graph_backward, counts
    # 2 blocks of 7 projections and one attention, and the head; backward: 2 gradient matmuls
    # per projection and 2 for the head, and each block's forward again but its last projection
    # (backward reads the other six's outputs).
    assert forward["aten::mm"] == 2 * 7 + 1, forward
    assert backward["aten::mm"] == 2 * 14 + 2 + 2 * 6, backward
    attention = [n for n in backward if "scaled_dot_product" in n and "backward" not in n]
    assert sum(backward[n] for n in attention) == 2, backward
