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

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zbuf.compile
from zbuf.compile.block_frames import block_frames_of
from zbuf.compile.block_replan import blocks_to_keep, plan_block_levels
from zbuf.compile.recompute_plan import RegionLevel
from zbuf.models import apply_activation_checkpointing, build_model, resolve_config
from zbuf.shard import root_of, shard
from parity import rel_err, token_batches, train_adamw

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

    replanner.grow = lambda b, r, w: grow(b, room(grow_blocks), w)
    if settle_blocks is not None:
        replanner.settle = lambda b, r, w: settle(b, room(settle_blocks), w)


def all_selective_one_kept(lv, n):
    """Every block keeps its matmul outputs, the last block keeps everything."""
    return n * lv[1].extra_bytes + (lv[2].extra_bytes - lv[1].extra_bytes)


def test_each_levels_frame_trains_like_the_reference():
    """Three blocks at three levels, three frames: losses and parameters as the reference's."""
    from zbuf.state_dict import full_state_dict

    init = decoder(3)
    data = token_batches(3)
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, data, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    model = shard(copy.deepcopy(init))
    zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto", fullgraph=True)
    frames = block_frames_of(model)
    frames.levels = {id(b): i for i, b in enumerate(model.layers)}
    losses = train_adamw(model, model, data, torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full, ref_sd = full_state_dict(model), ref.state_dict()
    assert max(rel_err(full[k], ref_sd[k]) for k in ref_sd) <= 1e-5
    assert frames.graphs_compiled == 3 and all(frames.has_frame(lv) for lv in range(3))
    assert root_of(model).pool.stats().checked_out == 0


def test_compiled_frames_do_not_grow_with_depth():
    """At 2 and 8 blocks: step 0 compiles the level-0 frame, the re-plan the two levels it uses
    (every block selective, the last kept), and nothing else: no model-wide graph, the same
    Dynamo frames at both depths."""
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
    # Step 0: the level-0 frame; the re-plan's step: the two levels in use; then nothing.
    assert work[8]["compiled"] == [1, 3, 3, 3] and work[8]["frames"] == 3, work


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
    assert m.recompute["regions_kept"] == 3 and m.recompiled
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
    """Hugging Face checkpoints inside the layer's ``__call__``: the level-0 frame finds the
    region and estimates it, the roomy re-plan keeps every layer (one more frame), and the
    losses stay the reference's."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=44, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=True, attention_dropout=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    init = transformers.Qwen3ForCausalLM(cfg)
    init.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = token_batches(3)

    def run(fn, model, memory=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for tokens in data:
            lo = fn(input_ids=tokens, labels=tokens, use_cache=False).loss
            lo.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if memory is not None:
                memory.close_step()
            out.append(lo.item())
        return out

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
    assert memory.measured.recompute["regions_kept"] == 3 and frames.graphs_compiled == 2
