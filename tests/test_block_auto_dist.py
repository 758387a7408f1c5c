"""Budgeted recompute under block frames on 2 and 3 gloo ranks ([Note: block levels] in
compile/block_replan.py). One launch per world size:

* parity across the re-plans: step 0 at level 0 (the user's checkpointing), the measured room
  grown into at step 1 (every block selective, the last one kept: three frames), the steady step's
  smaller room settled into at step 3 (the first block recomputed again, the rest selective);
  losses and parameters match the unsharded fp32 reference at 1e-5 before and after both, and
  every rank plans the same levels and issues the same collectives;
* blocks kept for backward ([Note: blocks kept for backward] in zbuf/compile/block_prefetch.py): grown
  into, settled out of, one block's gathers fewer per step while kept, parity throughout;
* level 0 run as the "keep" frame under an eager checkpoint: the re-plan to every block kept
  compiles nothing, parity throughout, each gradient reduce-scattered once per step;
* offloaded blocks ([Note: offloaded blocks] in compile/block_offload.py, the host link stood
  in on the CPU): every rank offloads the same blocks, parity throughout, and a rank that
  offloads others stops every rank at the first forward after the re-plan;
* the default's offloaded blocks ([Note: offloaded under the step's own peak] in
  compile/block_replan.py): planned from one profile agreed over ranks whose own differ, the
  same blocks offloaded on every rank, parity throughout;
* a rank whose blocks run at other levels than its peers' stops every rank with
  ``ScheduleMismatchError`` at the first forward after the re-plan ([Note: block order check]).
"""

from __future__ import annotations

import copy

import torch

from dist_utils import run_distributed
from parity import token_batches

RTOL = 1e-5
STEPS = 6


def _levels(frames, model):
    return [frames.levels.get(id(b), 0) for b in model.layers]


def _parity_case(rank, world):
    import zbuf.compile
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.shard import op_counts

    import test_block_auto as unit
    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init = unit.decoder(3)
    data = sm_tests._batches(97, world, STEPS)
    keep = {0, 1, 3, STEPS - 1}
    ref_losses, ref_states = sm_tests._reference(init, data, steps_to_keep=keep)
    model = zbuf.shard(copy.deepcopy(init))
    opt, sched = sm_tests._adamw(model.parameters())
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt)
    memory = zbuf.compile.step_memory_of(cm)
    unit.clamp_room(memory, unit.all_selective_one_kept,
                    lambda lv, n: 2 * lv[1].extra_bytes + lv[1].extra_bytes // 2)
    frames = block_frames_of(model)
    levels = []
    losses, states, rows = sm_tests._train_zbuf(
        cm, model, opt, sched, data, rank, world, memory, keep=keep,
        before=lambda i: levels.append(_levels(frames, model)))
    levels.append(_levels(frames, model))
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    errors = {i: sm_tests._worst(states[i], ref_states[i]) for i in states}
    assert max(errors.values()) <= RTOL, errors
    return {"levels": levels, "replanned": [r.replanned for r in rows],
            "measured": memory.measured._asdict(), "steady": memory.steady._asdict(),
            "graphs": frames.graphs_compiled, "errors": errors,
            "collectives": dict(op_counts(model))}


def _weights_case(rank, world):
    """Room for every block's activations and one and a half blocks' weights: the last block keeps
    its forward gather for backward (one block's gathers fewer per step), the pool's budget grows
    by it; the steady step's room holds the activations only, so the settle keeps no weights and
    the levels stay. Parity throughout."""
    import zbuf.compile
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.shard import op_counts, root_of

    import test_block_auto as unit
    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init = unit.decoder(3)
    data = sm_tests._batches(97, world, STEPS)
    ref_losses, ref_states = sm_tests._reference(init, data, steps_to_keep={STEPS - 1})
    model = zbuf.shard(copy.deepcopy(init))
    opt, sched = sm_tests._adamw(model.parameters())
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt, persist=True, persist_fraction=1.0)
    memory = zbuf.compile.step_memory_of(cm)
    frames = block_frames_of(model)
    pool = root_of(model).pool
    block = frames.plan.block_bytes
    unit.clamp_room(memory, lambda lv, n: n * lv[2].extra_bytes + 3 * block // 2,
                    lambda lv, n: n * lv[2].extra_bytes)
    seen = []

    def before(i):
        seen.append((op_counts(model)["all_gather"], len(frames.kept), pool.stats().budget_bytes,
                     pool.stats().outside_allocations))

    losses, states, rows = sm_tests._train_zbuf(cm, model, opt, sched, data, rank, world, memory,
                                                keep={STEPS - 1}, before=before)
    before(STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    assert sm_tests._worst(states[STEPS - 1], ref_states[STEPS - 1]) <= RTOL
    assert pool.stats().checked_out == 0
    # The kept block's buffers are within the pool's grown budget: after step 0 (whose
    # allocations meet the idle blocks of the case before, in this process's pool), nothing is
    # allocated outside it.
    assert seen[1][3] == seen[-1][3], seen
    return {"gathers": [b[0] - a[0] for a, b in zip(seen, seen[1:])],
            "kept_blocks": [s[1] for s in seen], "budgets": [s[2] for s in seen],
            "levels": _levels(frames, model), "pool_bytes": frames.plan.pool_bytes,
            "block_bytes": block, "measured": memory.measured._asdict(),
            "steady": memory.steady._asdict(),
            "block_params": len(frames.called[id(model.layers[2])].weights.specs)}


def _shared_case(rank, world):
    """Level 0 runs the "keep" frame under an eager checkpoint ([Note: block levels], 1): the
    re-plan to every block kept compiles nothing, parity before and after it, and every
    parameter's gradient reduce-scattered once per step (the checkpoint's recompute gathers
    again but is no use of its own)."""
    import zbuf.compile
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.shard import op_counts, root_of

    import test_block_auto as unit
    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init = unit.decoder(3)
    data = sm_tests._batches(97, world, STEPS)
    keep = {0, 1, STEPS - 1}
    ref_losses, ref_states = sm_tests._reference(init, data, steps_to_keep=keep)
    model = zbuf.shard(copy.deepcopy(init))
    opt, sched = sm_tests._adamw(model.parameters())
    cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                      fullgraph=True, optimizer=opt, persist=False)
    memory = zbuf.compile.step_memory_of(cm)
    every_block_kept = lambda lv, n: n * lv[2].extra_bytes  # noqa: E731
    unit.clamp_room(memory, every_block_kept, every_block_kept)
    frames = block_frames_of(model)
    seen, levels = [], []

    def before(i):
        counts = op_counts(model)
        seen.append((counts["reduce_scatter"], counts["all_gather"], frames.graphs_compiled))
        levels.append(_levels(frames, model))

    losses, states, rows = sm_tests._train_zbuf(cm, model, opt, sched, data, rank, world, memory,
                                                keep=keep, before=before)
    before(STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    errors = {i: sm_tests._worst(states[i], ref_states[i]) for i in states}
    assert max(errors.values()) <= RTOL, errors
    assert root_of(model).reduce_once.open_uses() == 0
    return {"reduces": [b[0] - a[0] for a, b in zip(seen, seen[1:])],
            "gathers": [b[1] - a[1] for a, b in zip(seen, seen[1:])],
            "snapshots": sorted(keep), "graphs": [s[2] for s in seen[1:]], "levels": levels,
            "params": len(root_of(model).specs), "shared": getattr(frames, "shared", None),
            "measured": memory.measured._asdict(), "errors": errors}


def _offload_case(rank, world):
    """Five blocks, room for two on their way to the host only, the host link stood in on the
    CPU (one copy per block forward): the first four blocks offloaded from step 1 on (the
    last one's copy drained at the model's output: [Note: the copy queue]), parity
    with the unsharded reference; then a rank that offloads one block fewer is refused."""
    import zbuf.compile
    from zbuf.compile import ScheduleMismatchError, block_replan
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.models import loss

    import test_block_auto as unit
    import test_block_offload as offload_tests
    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init = unit.decoder(5)
    data = sm_tests._batches(97, world, STEPS)
    ref_losses, ref_states = sm_tests._reference(init, data, steps_to_keep={STEPS - 1})
    link = block_replan.BlockReplanner._rank_host_link
    block_replan.BlockReplanner._rank_host_link = offload_tests._cpu_link(1)
    try:
        model = zbuf.shard(copy.deepcopy(init))
        opt, sched = sm_tests._adamw(model.parameters())
        cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                          fullgraph=True, optimizer=opt)
        memory = zbuf.compile.step_memory_of(cm)
        unit.clamp_room(memory, offload_tests._reserve_only, offload_tests._reserve_only)
        frames = block_frames_of(model)
        losses, states, _ = sm_tests._train_zbuf(cm, model, opt, sched, data, rank, world,
                                                 memory, keep={STEPS - 1})
    finally:
        block_replan.BlockReplanner._rank_host_link = link
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    error = sm_tests._worst(states[STEPS - 1], ref_states[STEPS - 1])
    assert error <= RTOL, error
    report = frames.offload.report()
    if rank == 1:  # a rank that offloads otherwise (a bug the check must catch)
        frames.offload.offloaded = frames.offload.offloaded - {id(model.layers[0])}
    frames.prefetch.check_next_forward()
    tokens = token_batches(1)[0]
    try:
        loss(cm, tokens[:, :-1], tokens[:, 1:])
        refused = None
    except ScheduleMismatchError as e:
        refused = str(e)
    return {"report": report, "levels": _levels(frames, model), "refused": refused}


def _default_offload_case(rank, world, last_rank_slow=False):
    """The default ([Note: offloaded under the step's own peak] in compile/block_replan.py), the
    host link and the room under the peak stood in on the CPU, each rank's profile a few KiB
    apart: every rank plans from the same agreed profile (each segment the largest of the
    ranks'), offloads the same blocks from step 1 on, keeps them at the steady step, and
    matches the unsharded reference. ``last_rank_slow``: the last rank's first step took
    5e12 s, so that rank alone would decline the plan's compile and the others take it ([Note:
    a re-plan's compile pays for itself]): every rank declines it, on the slowest rank's
    time, and trains at level 0."""
    import zbuf.compile
    from zbuf.compile import block_replan
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.memory import phases

    import test_block_auto as unit
    import test_block_offload as offload_tests
    import test_step_memory as sm_tests

    torch._dynamo.reset()
    init = unit.decoder(5)
    data = sm_tests._batches(97, world, STEPS)
    ref_losses, ref_states = sm_tests._reference(init, data, steps_to_keep={STEPS - 1})
    seen = []

    def ceiling(profile):
        seen.append((profile.forward, profile.backward))
        return block_replan.ReserveRoom(max((*profile.forward, *profile.backward)), 1 << 40,
                                        1 << 40)

    link, real_ceiling, fold = (block_replan.BlockReplanner._rank_host_link,
                                block_replan.reserve_ceiling, phases.PhaseMeter._fold)
    block_replan.BlockReplanner._rank_host_link = offload_tests._cpu_link(1)
    block_replan.reserve_ceiling = ceiling
    phases.PhaseMeter._fold = lambda self: fold(self) + 4096 * rank
    try:
        model = zbuf.shard(copy.deepcopy(init))
        opt, sched = sm_tests._adamw(model.parameters())
        cm = zbuf.compile(model, inner="aot_eager", fullgraph=True, optimizer=opt,
                          replan_payback_steps=offload_tests.EVERY_COMPILE_PAYS)
        memory = zbuf.compile.step_memory_of(cm)
        frames = block_frames_of(model)

        def before(step):
            # 5e12 s: past what the tiny blocks' modelled saving (0.65 us a step) earns in
            # EVERY_COMPILE_PAYS steps (7.5e11 s), within the agreement's int64 microseconds.
            if last_rank_slow and step == 1 and rank == world - 1:
                frames.started_at -= 5e12

        losses, states, _ = sm_tests._train_zbuf(cm, model, opt, sched, data, rank, world,
                                                 memory, keep={STEPS - 1}, before=before)
    finally:
        block_replan.BlockReplanner._rank_host_link = link
        block_replan.reserve_ceiling = real_ceiling
        phases.PhaseMeter._fold = fold
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    error = sm_tests._worst(states[STEPS - 1], ref_states[STEPS - 1])
    assert error <= RTOL, error
    return {"report": frames.offload.report(), "levels": _levels(frames, model),
            "profiles": seen, "steady_replanned": memory.steady.replanned}


def _mismatch_case(rank, world):
    import zbuf.compile
    from zbuf.compile import ScheduleMismatchError
    from zbuf.compile.block_frames import block_frames_of
    from zbuf.models import loss

    import test_block_auto as unit

    torch._dynamo.reset()
    model = zbuf.shard(unit.decoder(3))
    zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto", fullgraph=True)
    memory = zbuf.compile.step_memory_of(model)
    tokens = token_batches(1)[0]
    for _ in range(2):  # the measured step, then the step that grows (the same on both ranks)
        loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        memory.close_step()
    frames = block_frames_of(model)
    if rank == 1:  # a rank that planned otherwise (a bug the check must catch)
        frames.levels = {id(model.layers[2]): 1}
    frames.prefetch.check_next_forward()
    try:
        loss(model, tokens[:, :-1], tokens[:, 1:])
    except ScheduleMismatchError as e:
        return str(e)
    return None


def _worker(rank, world):
    return {"parity": _parity_case(rank, world), "weights": _weights_case(rank, world),
            "shared": _shared_case(rank, world), "offload": _offload_case(rank, world),
            "default_offload": _default_offload_case(rank, world),
            "declined_offload": _default_offload_case(rank, world, last_rank_slow=True),
            "mismatch": _mismatch_case(rank, world)}


def _check(results):
    out = [r["parity"] for r in results]
    for o in out:
        print(o["errors"])
        # Before each step: level 0 (steps 0 and 1: the re-plan takes effect in step 1's first
        # forward), then grown (every block selective, the last kept), then settled (the first
        # block recomputed again).
        assert o["levels"] == [[0, 0, 0]] * 2 + [[1, 1, 2]] * 2 + [[0, 1, 1]] * 3, o["levels"]
        assert o["replanned"] == [False, True, False, True, False, False], o["replanned"]
        m, s = o["measured"], o["steady"]
        assert m["recompiled"] and not s["recompiled"]  # the settle reuses frames 0 and 1
        assert (m["recompute"]["regions_selective"], m["recompute"]["regions_kept"]) == (2, 1)
        assert (s["recompute"]["regions_recomputed"], s["recompute"]["regions_selective"]) == (1, 2)
        assert s["recompute"]["kept_bytes"] < m["recompute"]["kept_bytes"]
        # One frame per level, whatever the depth; "recompute" and "keep" share theirs.
        assert o["graphs"] == 2, o
    # Every rank planned and issued alike.
    for o in out[1:]:
        for key in ("levels", "measured", "steady", "collectives"):
            assert o[key] == out[0][key], (key, o[key], out[0][key])
    weights = [r["weights"] for r in results]
    for w in weights:
        # (Before each step.) Kept from step 1 (the growth) until step 3 (the settle); levels
        # as grown throughout.
        assert w["kept_blocks"] == [0, 0, 1, 1, 0, 0, 0], w
        assert w["levels"] == [2, 2, 2], w
        assert w["budgets"][2] == w["pool_bytes"] + w["block_bytes"], w
        assert w["budgets"][4] == w["pool_bytes"], w
        # A kept block's backward gathers nothing: one block's gathers fewer in steps 1 and 2.
        g = w["gathers"]
        assert g[1] == g[2] == g[0] - w["block_params"] and g[3] == g[4] == g[0], g
        m, s = w["measured"], w["steady"]
        assert m["kept_weights"] == w["block_params"] and m["kept_bytes"] > 0, m
        assert s["replanned"] and s["kept_weights"] == 0 and not s["recompiled"], s
    for w in weights[1:]:
        assert w == weights[0]
    shared = [r["shared"] for r in results]
    for o in shared:
        print(o["errors"])
        assert o["shared"] and o["graphs"] == [1] * STEPS, o  # the re-plan compiled nothing
        assert o["levels"] == [[0, 0, 0]] * 2 + [[2, 2, 2]] * (STEPS - 1), o["levels"]
        m = o["measured"]
        assert m["replanned"] and not m["recompiled"], m
        # Each gradient reduce-scattered once a step, whether its block recomputed or kept.
        assert o["reduces"] == [o["params"]] * STEPS, o
        # At level 0 a block gathers for forward and again for its recompute; kept, once more
        # for backward (the frame's saved weights): the same count (a step whose state is
        # snapshotted gathers every parameter once more).
        g = [n - (o["params"] if i in o["snapshots"] else 0) for i, n in enumerate(o["gathers"])]
        assert len(set(g)) == 1, o
    for o in shared[1:]:
        for key in ("reduces", "gathers", "levels", "measured"):
            assert o[key] == shared[0][key], (key, o[key], shared[0][key])
    offload = [r["offload"] for r in results]
    for o in offload:
        assert o["report"]["blocks"] == [0, 1, 2, 3] and o["report"]["late_uploads"] == 0, o
        assert o["report"]["drained_at_output"], o
        assert o["report"]["moved_down_bytes"] == o["report"]["moved_up_bytes"] > 0, o
        assert o["levels"] == [2, 2, 2, 2, 0], o
        assert o["refused"] is not None and "activations offloaded" in o["refused"], o
    for o in offload[1:]:
        assert _agreed(o["report"]) == _agreed(offload[0]["report"])
    default = [r["default_offload"] for r in results]
    for o in default:
        assert o["report"]["blocks"] == [0, 1, 2, 3] and o["report"]["late_uploads"] == 0, o
        assert o["levels"] == [2, 2, 2, 2, 0] and not o["steady_replanned"], o
        assert len(o["profiles"]) == 2, o  # the measured step's, the steady step's
    for o in default[1:]:  # one agreed profile, though every rank's own differed
        assert o["profiles"] == default[0]["profiles"], (o["profiles"], default[0]["profiles"])
        assert _agreed(o["report"]) == _agreed(default[0]["report"])
    for r in results:
        declined = r["declined_offload"]
        assert declined["report"]["blocks"] == [] and declined["levels"] == [0] * 5, declined
        assert declined["report"]["declined_for_compile"]["first_step_s"] >= 5e12, declined
        assert declined["report"]["declined_for_compile"]["blocks"] == 4, declined
    for rank, r in enumerate(results):
        error = r["mismatch"]
        assert error is not None, rank
        assert "at level selective" in error or "at level recompute" in error, error


def _agreed(report: dict) -> dict:
    """An offload record less its wall times: what every rank's must share."""
    from zbuf.compile.block_offload import RANK_OWN

    return {k: v for k, v in report.items() if k not in RANK_OWN}


def test_two_ranks():
    _check(run_distributed(_worker, 2, timeout=600))


def test_three_ranks():
    _check(run_distributed(_worker, 3, timeout=600))
