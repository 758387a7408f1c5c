"""Budgeted recompute under block frames (``zbuf.compile(model, structure="blocks",
recompute="auto")``, [Note: block levels] in compile/block_replan.py), one process: the planner on
random levels, each level's frame against the unsharded reference, compiled frames that do not
grow with depth, a room that keeps nothing compiles nothing, and ``zbuf train``'s flags. Two and
three gloo ranks: test_block_auto_dist.py.

The measured room is made small where a test needs a mixed plan: ``clamp_room`` hands the
re-planner a room computed from the blocks' own estimate (rank-invariant, as the real room is).
"""

from __future__ import annotations

import copy
import os
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zbuf.compile
from zbuf.compile.block_frames import block_frames_of
from zbuf.compile.block_replan import blocks_to_keep
from zbuf.compile.recompute_plan import RegionLevel, plan_block_levels
from zbuf.models import apply_activation_checkpointing, build_model, resolve_config
from zbuf.shard import root_of, shard
from zbuf.state_dict import full_state_dict
from parity import hf_loss, rel_err, tiny_qwen3, token_batches, train_adamw

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))


@st.composite
def levels(draw):
    base = draw(st.floats(0, 1e-2))
    out = [RegionLevel("recompute", 0, base)]
    for name in ("selective", "keep")[: draw(st.integers(0, 2))]:
        out.append(RegionLevel(name, draw(st.integers(0, 1 << 12)), draw(st.floats(0, 1e-2))))
    return tuple(out)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(levels(), st.integers(0, 12), st.integers(-(1 << 10), 1 << 15), st.integers(0, 1 << 14))
def test_block_plan_fits_the_room_keeps_later_blocks_first_and_grows_with_it(lv, blocks, room,
                                                                             more):
    plan = plan_block_levels(lv, blocks, room)
    assert len(plan.levels) == blocks
    kept = sum(lv[i].extra_bytes for i in plan.levels)
    assert plan.kept_bytes == kept <= max(room, 1)
    assert list(plan.levels) == sorted(plan.levels)  # later blocks keep at least as much
    cheapest = min((x.extra_bytes for x in lv[1:] if x.recompute_seconds < lv[0].recompute_seconds),
                   default=None)
    if cheapest is None or cheapest > max(room, 1):
        assert not any(plan.levels)  # nothing that saves time fits: every block recomputes
    larger = plan_block_levels(lv, blocks, room + more)
    assert larger.saved_seconds >= plan.saved_seconds - 1e-12


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.integers(0, 12), st.integers(0, 1 << 12), st.integers(-(1 << 10), 1 << 16))
def test_blocks_kept_for_backward_fit_the_room_and_fill_it(blocks, block_bytes, room):
    kept = blocks_to_keep(blocks, block_bytes, room)
    assert 0 <= kept <= blocks
    assert kept * block_bytes <= max(room, 0)
    if block_bytes > 0 and kept < blocks:
        assert (kept + 1) * block_bytes > room  # one more would not fit


def decoder(layers: int):
    cfg = resolve_config("tiny").replace(num_layers=layers, vocab_size=97, hidden_size=64,
                                         ffn_hidden_size=128, head_dim=16)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, True)
    return init


def clamp_room(memory, grow_blocks, settle_blocks=None):
    """Make the re-planner's rooms the frames' pool plus ``grow_blocks(levels, n)`` bytes of kept
    activations (``settle_blocks`` for the steady step), from the blocks' estimate."""
    replanner = memory.replanner
    frames = replanner.frames
    grow, settle = replanner.grow, replanner.settle

    def room(extra):
        return frames.plan.pool_bytes + extra(frames.estimate.levels, len(frames.called))

    replanner.grow = lambda b, r, w, p: grow(b, room(grow_blocks), w, p)
    if settle_blocks is not None:
        replanner.settle = lambda b, r, w, p: settle(b, room(settle_blocks), w, p)


def all_selective_one_kept(lv, n):
    """Every block keeps its matmul outputs, the last block keeps everything."""
    return n * lv[1].extra_bytes + (lv[2].extra_bytes - lv[1].extra_bytes)


def _levels_against_reference(init, levels_of):
    """Train a sharded copy of ``init`` under blocks and auto with the levels ``levels_of(model)``
    set by hand, and the unsharded ``init`` as reference: losses and parameters within 1e-5.
    Returns the model and its frames."""
    data = token_batches(3)
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, data, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    model = shard(copy.deepcopy(init))
    zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto", fullgraph=True)
    frames = block_frames_of(model)
    frames.levels = levels_of(model)
    losses = train_adamw(model, model, data, torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    assert max(rel_err(full[k], ref_sd[k]) for k in ref_sd) <= 1e-5
    return model, frames


class _Measured(NamedTuple):
    """A 3-block decoder sharded and compiled under blocks and ``auto`` with its optimizer, its
    measured room clamped, beside its unsharded reference already trained on ``data``."""

    ref: torch.nn.Module
    ref_losses: list
    model: torch.nn.Module
    compiled: torch.nn.Module
    opt: torch.optim.Optimizer
    memory: object
    frames: object
    data: list


def _measured_against_reference(steps: int, room_blocks) -> _Measured:
    """``_Measured`` over ``steps`` batches, the room ``room_blocks(levels, n)`` at the grow and
    the settle (``clamp_room``)."""
    init = decoder(3)
    data = token_batches(steps)
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, data, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    model = shard(copy.deepcopy(init))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt)
    memory = zbuf.compile.step_memory_of(cm)
    clamp_room(memory, room_blocks, room_blocks)
    return _Measured(ref, ref_losses, model, cm, opt, memory, block_frames_of(model), data)


def test_each_levels_frame_trains_like_the_reference():
    """Three blocks at three levels, two frames (level 0 runs the "keep" frame under an eager
    checkpoint): losses and parameters as the reference's."""
    model, frames = _levels_against_reference(
        decoder(3), lambda m: {id(b): i for i, b in enumerate(m.layers)})
    assert frames.shared and frames.estimate.whole
    assert frames.graphs_compiled == 2 and all(frames.has_frame(lv) for lv in range(3))
    assert root_of(model).pool.stats().checked_out == 0


def test_compiled_frames_do_not_grow_with_depth():
    """At 2 and 8 blocks: step 0 compiles the shared frame (levels 0 and "keep"), the re-plan
    the one level it adds (every block selective, the last kept), and nothing else: no
    model-wide graph, the same Dynamo frames at both depths."""
    from torch._dynamo.utils import counters

    work = {}
    for layers in (2, 8):
        torch._dynamo.reset()
        counters.clear()
        model = shard(decoder(layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                          fullgraph=True, optimizer=opt)
        memory = zbuf.compile.step_memory_of(cm)
        clamp_room(memory, all_selective_one_kept)
        frames = block_frames_of(model)
        compiled = []
        for tokens in token_batches(4):
            train_adamw(cm, model, [tokens], opt, memory.close_step)
            compiled.append(frames.graphs_compiled)
        m = memory.measured
        levels = m.recompute
        work[layers] = dict(compiled=compiled, frames=counters["stats"]["unique_graphs"],
                            recompiles=sum(counters["recompiles"].values()))
        assert m.replanned and m.recompiled, m
        assert (levels["regions"], levels["regions_recomputed"], levels["regions_selective"],
                levels["regions_kept"]) == (layers, 0, layers - 1, 1), levels
        assert levels["kept_bytes"] > 0 and levels["partitions"] == 2
        assert [r.replanned for r in memory.rows] == [False, True, False, False]
        assert memory.steady is not None and not memory.steady.replanned
        assert root_of(model).pool.stats().budget_bytes == frames.plan.pool_bytes
    assert work[2] == work[8], work
    # Step 0: the shared frame; the re-plan's step: the selective one; then nothing.
    assert work[8]["compiled"] == [1, 2, 2, 2] and work[8]["frames"] == 2, work


def test_a_room_below_every_level_keeps_every_block_at_level_0_and_compiles_nothing():
    model = shard(decoder(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt)
    memory = zbuf.compile.step_memory_of(cm)
    clamp_room(memory, lambda lv, n: lv[1].extra_bytes - 1)
    train_adamw(cm, model, token_batches(4), opt, memory.close_step)
    frames = block_frames_of(model)
    assert frames.graphs_compiled == 1 and not frames.levels
    assert not memory.measured.replanned and not memory.measured.recompiled
    assert memory.measured.recompute["regions_recomputed"] == 3


def test_the_measured_room_plans_the_levels_without_a_clamp():
    """The room StepMemory measures (the CPU stand-in's agreed free memory) reaches the planner:
    a roomy step keeps every block, and the steady step's projection counts what they keep."""
    model = shard(decoder(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt, free_memory_bytes=1 << 30)
    memory = zbuf.compile.step_memory_of(cm)
    train_adamw(cm, model, token_batches(4), opt, memory.close_step)
    m, steady = memory.measured, memory.steady
    # Every block kept: the shared frame's level, nothing compiled ([Note: block levels], 1).
    assert m.recompute["regions_kept"] == 3 and m.replanned and not m.recompiled
    kept = memory.replanner.kept_activation_bytes
    assert kept == 3 * block_frames_of(model).estimate.levels[2].extra_bytes
    assert steady.backward_peak_bytes >= m.backward_peak_bytes + kept - (1 << 16)
    assert not steady.replanned
    # What the run record summarises (zbuf/train/record.py): the levels, as the whole graph's
    # schedule reports its regions.
    levels = memory.report()["measured"]["recompute"]
    assert (levels["regions"], levels["regions_kept"], levels["mode"]) == (3, 3, "auto")
    assert levels["forward_flops"] > 0 and levels["recomputed_flops"] == 0


def test_train_takes_blocks_with_ac_auto():
    from zbuf.train.config import TrainConfig

    cfg = TrainConfig(compile_structure="blocks", ac="auto").resolve(cuda=False, world=2,
                                                                     bench=False)
    assert (cfg.compile_structure, cfg.ac) == ("blocks", "auto")


def test_hugging_face_layers_take_levels():
    """Hugging Face checkpoints inside the layer's ``__call__``: the shared frame finds the
    region and estimates it, the roomy re-plan keeps every layer (no more frames), and the
    losses stay the reference's."""
    pytest.importorskip("transformers")

    init = tiny_qwen3(checkpointed=True)
    data = token_batches(3)

    def run(fn, model, memory=None):
        return train_adamw(fn, model, data, loss_of=hf_loss,
                           after_step=None if memory is None else memory.close_step)

    ref = copy.deepcopy(init)
    ref_losses = run(ref, ref)
    model = shard(copy.deepcopy(init))
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      free_memory_bytes=1 << 30)
    memory = zbuf.compile.step_memory_of(cm)
    losses = run(cm, model, memory)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    frames = block_frames_of(model)
    assert frames.estimate is not None and frames.estimate.levels[2].extra_bytes > 0
    # The layer's checkpoint covers its whole call: level 0 runs the "keep" frame under an eager
    # checkpoint, so the re-plan to every layer kept compiles nothing.
    assert frames.shared and frames.estimate.whole
    assert memory.measured.recompute["regions_kept"] == 3 and frames.graphs_compiled == 1
    assert memory.measured.replanned and not memory.measured.recompiled


def _counted_reduce_scatters(model):
    from zbuf.shard import op_counts

    return op_counts(model)["reduce_scatter"]


def test_recompute_and_keep_share_one_frame_so_the_replan_compiles_nothing():
    """[Note: block levels], 1: level 0 runs the "keep" frame under an eager checkpoint (the
    CPU's agreed memory predicts every block kept), so a re-plan to any mix of "recompute" and
    "keep" compiles nothing: one graph from step 0 on, the
    losses and parameters the reference's, every gradient reduce-scattered once per step."""
    # Room for every block kept (no selective level: "keep" saves more time per byte here).
    ref, ref_losses, model, cm, opt, memory, frames, data = _measured_against_reference(
        5, lambda lv, n: n * lv[2].extra_bytes)
    params = len(root_of(model).specs)
    from zbuf.shard import op_counts

    compiled, levels, reduces, gathers = [], [], [], []
    losses = []
    for i, tokens in enumerate(data):
        if i == 3:  # a mixed plan, set by hand: the first block recomputes again
            frames.levels = {id(b): 2 for b in model.layers[1:]}
        if i == 4:  # ... and keeps its forward gather for its recompute
            frames.kept = frozenset({id(model.layers[0])})
        before = _counted_reduce_scatters(model), op_counts(model)["all_gather"]
        losses += train_adamw(cm, model, [tokens], opt, memory.close_step)
        reduces.append(_counted_reduce_scatters(model) - before[0])
        gathers.append(op_counts(model)["all_gather"] - before[1])
        compiled.append(frames.graphs_compiled)
        levels.append([frames.levels.get(id(b), 0) for b in model.layers])
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    assert max(rel_err(full[k], ref_sd[k]) for k in ref_sd) <= 1e-5
    assert levels[1:3] == [[2, 2, 2]] * 2 and levels[3:] == [[0, 2, 2]] * 2, levels
    assert memory.measured.replanned and not memory.measured.recompiled
    assert compiled == [1] * 5 and frames.shared and not frames.has_frame(1), compiled
    assert reduces == [params] * 5, reduces  # once per parameter per step, at every level
    block_params = len(frames.called[id(model.layers[0])].weights.specs)
    assert gathers[4] == gathers[3] - block_params, gathers  # the kept block's recompute
    assert root_of(model).reduce_once.open_uses() == 0
    assert root_of(model).pool.stats().checked_out == 0


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(levels(), st.integers(1, 12), st.integers(-(1 << 10), 1 << 15))
def test_the_shared_level_is_the_one_the_predicted_plan_uses_most(lv, blocks, room):
    from collections import Counter

    from zbuf.compile.block_frames import choose_shared_level

    level = choose_shared_level(lv, blocks, room)
    assert level in (1, 2)
    used = Counter(x for x in plan_block_levels(lv, blocks, room).levels if x)
    if len(lv) < 3 or not used:
        assert level == 2  # "keep", as before the choice existed
    else:
        assert used[level] == max(used.values()) and (level == 2 or used[2] < used[1])


def test_a_room_for_selective_blocks_shares_level_0_with_selective_and_compiles_nothing_more():
    """[Note: block levels], 1: when the agreed memory predicts a plan of selective blocks, the
    shared frame compiles at "selective", so the measured re-plan to every block selective
    compiles nothing (one graph from step 0 on, as qwen3-14b's plan is made of "recompute" and
    "selective"); a block at "keep" then gets its own frame. Losses and parameters stay the
    reference's."""
    from zbuf.compile.block_frames import choose_shared_level
    # A probe reads the block's levels; the model under test then predicts from an agreed
    # memory with room for every block selective and for few blocks kept.
    probe = shard(decoder(3))
    zbuf.compile(probe, inner="aot_eager", structure="blocks", recompute="auto", fullgraph=True)
    train_adamw(probe, probe, token_batches(1))
    lv = block_frames_of(probe).estimate.levels
    room = 3 * lv[1].extra_bytes
    assert choose_shared_level(lv, 3, room) == 1 and lv[2].extra_bytes > lv[1].extra_bytes

    ref, ref_losses, model, cm, opt, memory, frames, data = _measured_against_reference(
        5, lambda lv, n: n * lv[1].extra_bytes)
    frames.plan = frames.plan._replace(memory_bytes=frames.plan.pool_bytes + room)
    compiled, levels, losses = [], [], []
    for i, tokens in enumerate(data):
        if i == 4:  # a block at "keep", set by hand: the one frame the sharing did not cover
            frames.levels = {**frames.levels, id(model.layers[2]): 2}
        losses += train_adamw(cm, model, [tokens], opt, memory.close_step)
        compiled.append(frames.graphs_compiled)
        levels.append([frames.levels.get(id(b), 0) for b in model.layers])
    assert frames.shared_level == 1 and frames.shared and frames.estimate.level == 1
    assert levels[1:4] == [[1, 1, 1]] * 3 and levels[4] == [1, 1, 2], levels
    assert memory.measured.replanned and not memory.measured.recompiled
    assert compiled == [1, 1, 1, 1, 2], compiled
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    assert max(rel_err(full[k], ref_sd[k]) for k in ref_sd) <= 1e-5
    assert root_of(model).pool.stats().checked_out == 0


class _PartlyCheckpointed(type(decoder(1).layers[0])):
    """A block whose checkpoint leaves an op out (the tanh after it)."""

    def forward(self, x, cos, sin):
        h = super().forward(x, cos, sin)
        return h + 0.1 * torch.tanh(h)


@pytest.mark.parametrize("kind", ["partial", "selective"])
def test_a_checkpoint_that_is_not_the_whole_block_gets_a_level_0_frame_of_its_own(kind):
    """The user's checkpoint leaves part of the block out, or saves some of it (a selective
    policy): recomputing the whole block is not level 0, so level 0 gets its own frame as before
    (the shared one ran the first call only), and training stays the reference's."""
    init = decoder(3)
    if kind == "partial":
        for b in init.layers:
            b.__class__ = _PartlyCheckpointed
    else:
        apply_activation_checkpointing(init, "selective")
    _, frames = _levels_against_reference(init, lambda m: {id(m.layers[2]): 2})
    assert not frames.estimate.whole and frames.shared is False
    assert frames.graphs_compiled == 2 and frames.has_frame(0) and frames.has_frame(2)


def test_level_0_keeps_only_the_blocks_inputs():
    """At level 0 the shared frame runs under an eager checkpoint with no saved-tensor hooks of
    its own: the frame saves no activation past the block's call (the checkpoint keeps the
    block's inputs only), where the "checkpointed" mode's frame saves its region's inputs and
    whatever its partition keeps. Counted at the frames' saved-tensor hooks (SavedBlock.pack:
    what a frame saves that is not a gathered weight) and at the checkpoint's inputs."""
    from zbuf.compile import block_prefetch
    from zbuf.compile import block_frames

    def saved_bytes(recompute):
        torch._dynamo.reset()
        model = shard(decoder(3))
        zbuf.compile(model, inner="aot_eager", structure="blocks", recompute=recompute,
                     fullgraph=True)
        counted = {"frame": 0, "inputs": 0}
        pack = block_prefetch.SavedBlock.pack
        checkpoint = torch.utils.checkpoint.checkpoint

        def counting_pack(self, t):
            out = pack(self, t)
            if out is t and isinstance(t, torch.Tensor):  # not a gathered weight
                counted["frame"] += t.untyped_storage().nbytes()
            return out

        def counting_checkpoint(fn, *args, **kwargs):
            counted["inputs"] += sum(a.untyped_storage().nbytes() for a in args
                                     if isinstance(a, torch.Tensor))
            return checkpoint(fn, *args, **kwargs)

        from unittest import mock
        with mock.patch.object(block_prefetch.SavedBlock, "pack", counting_pack), \
                mock.patch.object(block_frames, "eager_checkpoint", counting_checkpoint,
                                  create=True):
            from zbuf.models import loss
            tokens = token_batches(1)[0]
            loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        return counted

    checkpointed, auto = saved_bytes("checkpointed"), saved_bytes("auto")
    assert checkpointed["frame"] > 0 and checkpointed["inputs"] == 0, checkpointed
    assert auto["frame"] == 0 and 0 < auto["inputs"] <= checkpointed["frame"], (auto,
                                                                               checkpointed)


def test_a_block_without_checkpointing_runs_level_0_without_a_checkpoint(monkeypatch):
    """Under ``auto`` a model the user did not checkpoint has nothing for level 0 to recompute:
    once its frame's graph shows no checkpointed region, its blocks run without the eager
    checkpoint that level 0 shares the frame under ([Note: block levels], 1), so backward
    re-runs no block (before, every block of every step ran its forward twice)."""
    from zbuf.compile import block_frames

    cfg = resolve_config("tiny").replace(num_layers=3, vocab_size=97, hidden_size=64,
                                         ffn_hidden_size=128, head_dim=16)
    torch.manual_seed(0)
    init = build_model(cfg)  # no apply_activation_checkpointing
    model = shard(copy.deepcopy(init))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt)
    checkpointed = []
    checkpoint = block_frames.eager_checkpoint

    def counting(fn, *args, **kwargs):
        checkpointed.append(fn)
        return checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(block_frames, "eager_checkpoint", counting)
    batches = token_batches(3)
    losses = train_adamw(cm, model, batches, opt)
    frames = block_frames_of(model)
    assert (frames.shared, frames.shared_level) == (False, 0)
    assert len(checkpointed) == 1  # the call that compiled the frame, before its graph was seen
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, batches, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
