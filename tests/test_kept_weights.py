"""Weights kept for backward at run time ([Note: weights kept at run time] in zbuf/kept_weights.py,
[Note: the run-time keep-set] in zbuf/compile/persist.py): the chooser, the graph ops, and a
re-plan that grows the keep-set without compiling anything."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_distributed
from zbuf.compile.persist import KeepCandidate, choose_kept, keep_order

RTOL = 1e-5

# -- the chooser -------------------------------------------------------------------------------

_candidates = st.lists(
    st.builds(KeepCandidate, key=st.integers(0, 10_000), nbytes=st.integers(0, 1 << 20),
              need=st.integers(0, 500), pool_id=st.integers(-1, 2)),
    max_size=40, unique_by=lambda c: c.key)


@settings(max_examples=300, deadline=None)
@given(_candidates, st.integers(-(1 << 20), 8 << 20), st.sampled_from([0, 3000, 1 << 18, 1 << 30]),
       st.randoms(use_true_random=False))
def test_keep_set_is_within_the_cap_deterministic_and_in_persistence_order(cands, cap, bound, rnd):
    kept = choose_kept(cands, cap, bound)
    # Within the cap (nothing at all below zero).
    assert sum(c.nbytes for c in kept) <= cap or not kept
    assert cap >= 0 or not kept
    # Deterministic: the same set, in the same order, whatever order the candidates come in
    # (ranks may read them in any order; they must flip the same set).
    shuffled = list(cands)
    rnd.shuffle(shuffled)
    assert choose_kept(shuffled, cap, bound) == kept
    # Order: latency-bound gathers first, then by backward need, then smaller, then by key; a
    # candidate is left out only if it did not fit beside those kept before it in that order.
    order = sorted(cands, key=lambda c: keep_order(c, bound))
    assert list(kept) == [c for c in order if c in kept]
    taken = 0
    for c in order:
        if c in kept:
            taken += c.nbytes
        else:
            assert taken + c.nbytes > cap, (c, taken, cap)
    # A large gather is kept only when every latency-bound one that fits is kept too.
    if any(c.nbytes >= bound for c in kept):
        small = [c for c in cands if c.nbytes < bound]
        assert all(c in kept or c.nbytes > cap for c in small)


def test_keep_set_prefers_what_backward_needs_first():
    a = KeepCandidate(key=1, nbytes=100, need=50)
    b = KeepCandidate(key=2, nbytes=100, need=10)
    c = KeepCandidate(key=3, nbytes=10, need=90)  # latency-bound: first whatever its need
    assert choose_kept([a, b, c], 110, latency_bound_bytes=50) == (c, b)
    assert choose_kept([a, b, c], 99, latency_bound_bytes=50) == (c,)
    assert choose_kept([a, b, c], -1, latency_bound_bytes=50) == ()


# -- on two ranks ------------------------------------------------------------------------------


def _ops_case(rank, world):
    """The graph ops on a kept weight: forward's release holds its buffer (poisoned releases
    leave it intact, no other gather gets it), backward's gather hands it back with no
    collective, and backward's release returns it to the pool."""
    from zbuf import runtime
    from zbuf.kept_weights import HOLDS, TAKES
    from zbuf.memory import pool_budget
    from zbuf.pool import GatherBufferPool

    assert runtime.POISON_RELEASES
    ops = torch.ops.zbuf
    group = dist.group.WORLD.group_name
    pool = GatherBufferPool("cpu", budget_bytes=1 << 20)
    pool_id = runtime.pool_id_of(pool)
    kept_id, other_id = 97_001, 97_002
    shard = torch.full((4,), float(rank + 1))
    nbytes = world * 4 * 4
    budget0 = pool.stats().budget_bytes
    pool_budget.keep_weights(pool, {kept_id: nbytes})
    out = {"budget_moved": pool.stats().budget_bytes - budget0 == pool.capacity_for(nbytes)}

    collectives = []
    real_gather = dist.all_gather_into_tensor

    def counting(*args, **kwargs):
        collectives.append(args[0].numel())
        return real_gather(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        # Forward: gather, read, release (held).
        token = torch.empty(0)
        buf = ops.gather_buffer(token, shard, kept_id, [world * 4], group, None, pool_id, HOLDS)
        ops.all_gather_start(token, [buf], [shard], group)
        ops.all_gather_wait(token, [buf])
        expected = buf.tolist()
        ops.all_gather_release(token, [buf], [pool_id], [])
        out["held"] = list(pool.kept.held)
        out["forward_collectives"] = len(collectives)
        ptr = buf.untyped_storage().data_ptr()
        # Another gather of the same size while it is held: a different block.
        token = torch.empty(0)
        other = ops.gather_buffer(token, shard * 10, other_id, [world * 4], group, None, pool_id,
                                  HOLDS)
        out["other_block_differs"] = other.untyped_storage().data_ptr() != ptr
        ops.all_gather_start(token, [other], [shard * 10], group)
        ops.all_gather_wait(token, [other])
        ops.all_gather_release(token, [other], [pool_id], [])  # poisoned: NaN
        # Backward: the held buffer, intact, with no collective.
        token = torch.empty(0)
        before = len(collectives)
        again = ops.gather_buffer(token, shard, kept_id, [world * 4], group, None, pool_id, TAKES)
        ops.all_gather_start(token, [again], [shard], group)
        ops.all_gather_wait(token, [again])
        out["backward_collectives"] = len(collectives) - before
        out["same_block"] = again.untyped_storage().data_ptr() == ptr
        out["intact"] = again.tolist() == expected
        ops.all_gather_release(token, [again], [pool_id], [])
        out["released"] = not pool.kept.held and pool.stats().checked_out == 0
        # A second backward gather of it finds nothing held: a real collective.
        token = torch.empty(0)
        before = len(collectives)
        third = ops.gather_buffer(token, shard, kept_id, [world * 4], group, None, pool_id, TAKES)
        ops.all_gather_start(token, [third], [shard], group)
        ops.all_gather_wait(token, [third])
        out["regathered"] = len(collectives) - before == 1 and third.tolist() == expected
        ops.all_gather_release(token, [third], [pool_id], [])
    finally:
        dist.all_gather_into_tensor = real_gather
    pool_budget.keep_weights(pool, {})
    out["budget_back"] = pool.stats().budget_bytes == budget0
    return out


def _mismatch_case(rank, world):
    """Ranks whose keep-sets differ stop with ScheduleMismatchError naming the keep-set, instead
    of pairing a skipped gather with a real one."""
    from zbuf import runtime
    from zbuf.compile.collectives import with_keep_sets
    from zbuf.memory import pool_budget
    from zbuf.compile.fingerprint import (ScheduleMismatchError, check_across_ranks,
                                          describe_graph, fingerprint_of)

    group = dist.group.WORLD.group_name
    pool = runtime.pool_of(runtime.DEFAULT_POOL, torch.empty(0))
    pool_id = runtime.pool_id_of(pool)
    description = describe_graph(torch.fx.Graph(), ["x"])
    fp = fingerprint_of(description)

    def check():  # what zbuf::check_schedule does on every run
        check_across_ranks(group, *with_keep_sets(torch.empty(0), [pool_id], fp, description))

    check()  # the same keep-set (none) on both ranks: passes
    pool_budget.keep_weights(pool, {97_101: 64} if rank == 0 else {})
    try:
        check()
        message = None
    except ScheduleMismatchError as e:
        message = str(e)
    finally:
        pool_budget.keep_weights(pool, {})
    return message


def _tiny():
    from zbuf.models import build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=2, vocab_size=97)
    torch.manual_seed(0)
    return build_model(cfg), cfg


def _training_setup(world, steps, prepare=None):
    """A fresh Dynamo, the tiny model (``prepare``d, e.g. checkpointed), its batches and its
    unsharded fp32 reference (last step's state kept), the sharded copy on a free memory of 20
    shards' bytes, and its AdamW: what each training case starts from."""
    import zbuf

    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init, cfg = _tiny()
    if prepare is not None:
        prepare(init)
    batches = sm_tests._batches(cfg.vocab_size, world, steps)
    ref_losses, ref_states = sm_tests._reference(init, batches, steps_to_keep={steps - 1})
    model = zbuf.shard(copy.deepcopy(init))
    sm_tests._shrink_free_memory(int(20 * sm_tests._shard_bytes(model)))
    opt, sched = sm_tests._adamw(model.parameters())
    return batches, ref_losses, ref_states, model, opt, sched


def _grow_without_compile_case(rank, world, inner="aot_eager"):
    """After the measured step the re-plan keeps weights for backward and compiles nothing
    (no Dynamo frame, no AOT graph, no schedule record); the steps after it match an unsharded
    fp32 reference, with fewer gathers per step."""
    import zbuf
    from torch._dynamo.utils import counters

    import test_step_memory as sm_tests

    counters.clear()
    steps = 4
    batches, ref_losses, ref_states, model, opt, sched = _training_setup(world, steps)
    cm = zbuf.compile(model, structure="graph", inner=inner, optimizer=opt)
    sm = zbuf.compile.step_memory_of(cm)
    compiles, gathers = [], []

    def before(i):
        compiles.append((counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"],
                         len(zbuf.schedule_report(model))))
        gathers.append(zbuf.shard.op_counts(model)["all_gather"])

    losses, states, rows = sm_tests._train_zbuf(cm, model, opt, sched, batches, rank, world, sm,
                                                keep={steps - 1}, before=before)
    before(steps)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    errors = {i: sm_tests._worst(states[i], ref_states[i]) for i in states}
    assert max(errors.values()) <= RTOL, errors
    pool = model.__dict__["_zbuf_root"].pool
    return {"replanned": [r.replanned for r in rows], "measured": sm.measured._asdict(),
            "compiles": compiles, "gathers_per_step": [b - a for a, b in zip(gathers, gathers[1:])],
            "kept": sorted(pool.kept.nbytes.items()), "held_after": len(pool.kept.held),
            "records": len(zbuf.schedule_report(model))}


def _auto_case(rank, world):
    """recompute="auto": growing its kept activations compiles the model again (graph
    structure), and the new plan's keep-set is chosen at the steady step, from its records,
    compiling nothing more; parity holds throughout."""
    import zbuf
    from zbuf.models import apply_activation_checkpointing

    import test_step_memory as sm_tests

    steps = 5
    batches, ref_losses, ref_states, model, opt, sched = _training_setup(
        world, steps, prepare=apply_activation_checkpointing)
    cm = zbuf.compile(model, structure="graph", inner="aot_eager", optimizer=opt, recompute="auto")
    sm = zbuf.compile.step_memory_of(cm)
    losses, states, rows = sm_tests._train_zbuf(cm, model, opt, sched, batches, rank, world, sm,
                                                keep={steps - 1})
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    assert sm_tests._worst(states[steps - 1], ref_states[steps - 1]) <= RTOL
    pool = model.__dict__["_zbuf_root"].pool
    return {"replanned": [r.replanned for r in rows], "measured": sm.measured._asdict(),
            "steady": sm.steady._asdict(), "kept": sorted(pool.kept.nbytes.items()),
            "records": [(r.kind, r.persistent_bytes) for r in zbuf.schedule_report(model)]}


def _worker(rank, world, with_inductor):
    from zbuf import runtime

    # Workers fork from a server that imported zbuf long before this test (tests/dist_utils.py),
    # so ZBUF_POISON_RELEASES in the environment now would be read by nobody: set the flag.
    runtime.POISON_RELEASES = True
    out = {"ops": _ops_case(rank, world), "mismatch": _mismatch_case(rank, world),
           "whole": _grow_without_compile_case(rank, world),
           "auto": _auto_case(rank, world)}
    if with_inductor:  # Inductor's generated code around the held buffers (5-6 min on CI's CPU)
        out["inductor"] = _grow_without_compile_case(rank, world, inner="inductor")
    return out


WITH_INDUCTOR = os.environ.get("ZBUF_TEST_INDUCTOR", "0") == "1"


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_worker, 2, WITH_INDUCTOR, timeout=1200 if WITH_INDUCTOR else 600)


def test_a_kept_weights_backward_gather_issues_no_collective_and_its_buffer_stays_held(two_ranks):
    for r in two_ranks:
        o = r["ops"]
        assert o["budget_moved"] and o["budget_back"], o  # held bytes count against the pool
        assert o["held"] == [97_001] and o["forward_collectives"] == 1, o
        # While held, another gather of the same size gets another block (and its poisoned
        # release leaves the held weight intact).
        assert o["other_block_differs"] and o["intact"] and o["same_block"], o
        assert o["backward_collectives"] == 0, o
        assert o["released"] and o["regathered"], o


def test_ranks_with_different_keep_sets_stop_with_a_mismatch(two_ranks):
    for r in two_ranks:
        assert r["mismatch"] is not None and "kept" in r["mismatch"], r["mismatch"]


@pytest.mark.parametrize("structure", [
    "whole",
    pytest.param("inductor", marks=pytest.mark.skipif(not WITH_INDUCTOR,
                                                      reason="ZBUF_TEST_INDUCTOR=1 runs it"))])
def test_growing_the_keep_set_compiles_nothing_and_keeps_parity(two_ranks, structure):
    out = [r[structure] for r in two_ranks]
    for o in out:
        assert o["replanned"] == [False, True, False, False], o
        m = o["measured"]
        assert m["replanned"] and not m["recompiled"], m
        assert m["kept_bytes"] > 0 and m["kept_weights"] == len(o["kept"]) > 0, m
        assert m["kept_bytes"] == sum(n for _, n in o["kept"])
        # Step 0 compiled the model; from step 1 on (the re-plan included) nothing more: no new
        # Dynamo graph, no AOT compile, no new schedule record.
        compiled_at_0 = o["compiles"][1]
        assert compiled_at_0[0] > 0 and compiled_at_0[1] > 0 and compiled_at_0[2] == 2, o
        assert o["compiles"][1:] == [compiled_at_0] * (len(o["compiles"]) - 1), o["compiles"]
        # Every kept weight's backward gather is skipped: that many fewer gathers per step
        # (the last step's count also has the state dict's gathers).
        g = o["gathers_per_step"]
        assert g[0] - g[1] == m["kept_weights"] and g[1] == g[2], g
        assert o["held_after"] == 0  # every held buffer went back in backward
    assert out[0]["measured"] == out[1]["measured"] and out[0]["kept"] == out[1]["kept"]


def test_auto_recompiles_for_activations_then_keeps_weights_without_compiling(two_ranks):
    out = [r["auto"] for r in two_ranks]
    for o in out:
        # Step 1: compiled again (auto's kept activations are graph structure); step 3 (after
        # the steady step 2): the new plan's keep-set, nothing compiled.
        assert o["replanned"] == [False, True, False, True, False], o
        assert o["measured"]["recompiled"] and o["measured"]["kept_bytes"] == 0, o["measured"]
        assert not o["steady"]["recompiled"] and o["steady"]["kept_bytes"] > 0, o["steady"]
        assert o["steady"]["kept_bytes"] == sum(n for _, n in o["kept"])
        # Two plans compiled in all, neither keeping weights in its graphs.
        assert o["records"] == [("forward", 0), ("backward", 0)] * 2, o["records"]
    assert out[0]["steady"] == out[1]["steady"] and out[0]["kept"] == out[1]["kept"]
