"""Offloaded blocks ([Note: offloaded blocks] in zbuf/compile/block_offload.py): the planner's
third choice beside keeping and recomputing a block's activations, planned on random inputs, and
run on the CPU stand-in through ``zbuf.compile(model, optimizer=opt, structure="blocks",
recompute="auto")`` against an unsharded reference and against the same blocks kept on the
device."""

from __future__ import annotations

import copy
import gc
import math
import os
import threading
from typing import NamedTuple

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import zbuf.compile
from zbuf.compile import block_offload, block_replan, recompute_plan
from zbuf.compile.block_clock import BlockClock
from zbuf.compile.block_frames import block_frames_of
from zbuf.compile.recompute import LEVELS
from zbuf.compile.recompute_plan import LINK_SHARE, HostLink, RegionLevel, plan_block_levels
from zbuf.memory import StepProfile
from zbuf.shard import root_of, shard
from zbuf.state_dict import full_state_dict
from parity import decoder_loss, hf_loss, rel_err, token_batches, train_adamw
from test_block_auto import clamp_room, decoder

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))

GiB = 1 << 30

EVERY_COMPILE_PAYS = 1 << 60
"""A payback horizon past any first step: the tiny blocks' modelled saving (microseconds)
pays for their frame's compile ([Note: a re-plan's compile pays for itself])."""


@st.composite
def block_levels(draw):
    """Recompute, selective, keep: each higher level keeps more and recomputes less."""
    base = draw(st.floats(1e-4, 1e-1))
    selective = draw(st.integers(1, 1 << 12))
    keep = selective + draw(st.integers(0, 1 << 12))
    return (RegionLevel("recompute", 0, base),
            RegionLevel("selective", selective, base * draw(st.floats(0, 1))),
            RegionLevel("keep", keep, 0.0))


@st.composite
def levels_and_link(draw):
    lv = draw(block_levels())
    nbytes = lv[2].extra_bytes
    # A "keep" block's copy takes 0 to 100 ms; a block's forward 0 to 100 ms.
    speed = nbytes / draw(st.floats(1e-9, 1e-1))
    # The model's output 1 to 4 block forwards after its last block begins.
    return lv, HostLink(speed, draw(st.floats(0, 1e-1)), draw(st.integers(0, 16 * nbytes)),
                        draw(st.floats(1, 4)))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@example(levels_link=((RegionLevel("recompute", 0, 0.0625), RegionLevel("selective", 1, 0.0),
                       RegionLevel("keep", 1, 0.0)), HostLink(16.0, 5e-324, 0)),
         blocks=1, room=2, saved=0)  # a copy that takes more forwards than a float holds
@example(levels_link=((RegionLevel("recompute", 0, 0.0625), RegionLevel("selective", 1, 0.0),
                       RegionLevel("keep", 16, 0.0)), HostLink(256.0, 2.225073858507e-311, 2, 1.0)),
         blocks=3, room=3, saved=0)  # a copy of finite forwards whose sums overflow
@given(levels_and_link(), st.integers(0, 24), st.integers(-(1 << 10), 1 << 16),
       st.sampled_from([0, 1, 1 << 10, 1 << 12]))
def test_offloaded_blocks_fit_the_room_the_host_and_the_link_and_only_when_they_save_time(
        levels_link, blocks, room, saved):
    """``saved``: what level 0 saves of each call (a user's selective policy's outputs), which
    an offloaded call moves beside its level's bytes but which level 0 held on the device
    anyway."""
    lv, link = levels_link
    on_device = plan_block_levels(lv, blocks, room)
    plan = plan_block_levels(lv, blocks, room, link, moved_beside_bytes=saved)
    assert len(plan.levels) == blocks
    if not plan.offloaded:
        assert plan == on_device  # nothing offloaded: the plan without a link
        return
    # On the device: what the other blocks keep, and two offloaded blocks on their way.
    kept = sum(lv[level].extra_bytes for b, level in enumerate(plan.levels)
               if b not in plan.offloaded)
    assert plan.kept_bytes == kept
    # All at one level above 0, whose bytes each moves; two of them on the device at most.
    level = plan.levels[plan.offloaded[0]]
    assert level >= 1 and all(plan.levels[b] == level for b in plan.offloaded)
    assert plan.offload_block_bytes == lv[level].extra_bytes + saved and plan.host_link == link
    queue = plan.copy_queue
    assert queue.positions == plan.offloaded and queue.in_flight in recompute_plan.IN_FLIGHT
    assert plan.offload_reserve_bytes == queue.in_flight * lv[level].extra_bytes
    assert plan.modelled_peak_bytes <= max(room, 1)
    assert len(plan.offloaded) * plan.offload_block_bytes <= link.host_bytes
    assert_copies_never_wait(plan.copy_queue, plan.offload_block_bytes, link, blocks)
    # The offloaded blocks come before every block the plan keeps on the device.
    on_device_levels = [level for b, level in enumerate(plan.levels) if b not in plan.offloaded]
    assert on_device_levels == sorted(on_device_levels)
    assert max(plan.offloaded) < on_device_levels.count(0) + len(plan.offloaded)
    # Taken only when it saves more modelled recompute than the plan without it.
    assert plan.saved_seconds > on_device.saved_seconds
    base = blocks * lv[0].recompute_seconds
    assert plan.recompute_seconds == pytest.approx(base - plan.saved_seconds, abs=1e-9)
    # The level offloaded saves the most (a tie goes to the lower level, fewer bytes moved).
    for other in range(1, len(lv)):
        alternative = recompute_plan._offloaded_at(other, lv, blocks, room, link, None, None,
                                                   on_device, saved)
        if alternative is not None:
            assert alternative.saved_seconds <= plan.saved_seconds
            assert alternative.saved_seconds < plan.saved_seconds or other >= level


def assert_copies_never_wait(queue, block_bytes: int, link: HostLink, blocks: int) -> None:
    """The offloaded calls' copies, one after another on the link, in block forwards (block
    ``p``'s forward runs from ``p`` to ``p + 1``), never make the compute stream wait ([Note:
    the copy queue]): a call's first save, as its block's forward ends, finds the copies of the
    call ``in_flight - 1`` before it done, and the drain, after the last call and no later than
    the last block, or at the model's output (``link.tail_forwards`` after the last block
    begins), finds every copy done. The last block is never offloaded. In backward each upload
    runs under ``upload_ahead``
    blocks' backward (each at least twice its forward), with at most ``in_flight`` calls'
    uploads on the device at once."""
    copies = block_bytes / (LINK_SHARE * link.bytes_per_second) / link.forward_seconds
    ends: list[float] = []
    for k, p in enumerate(queue.positions):
        waited = k - (queue.in_flight - 1)
        if waited >= 0:
            assert ends[waited] <= p + 1 + 1e-9, (k, p, ends[waited])
        ends.append(max(p + 1.0, ends[-1] if ends else 0.0) + copies)
    assert queue.positions[-1] < min(queue.drained_at, blocks - 1) and queue.drained_at <= blocks
    drain = queue.drained_at if queue.drained_at < blocks else blocks - 1 + link.tail_forwards
    assert ends[-1] <= drain + 1e-9
    if queue.drained_at < blocks:  # the first block the last copy's end allows
        assert queue.drained_at == max(queue.positions[-1] + 1, math.ceil(ends[-1] - 1e-9))
    assert 2 * queue.upload_ahead >= copies - 1e-9
    assert all(sum(p <= q <= p + queue.upload_ahead for q in queue.positions) <= queue.in_flight
               for p in queue.positions)


@given(st.floats(1e6, 1e12), st.floats(1e6, 1e12))
def test_the_queue_counts_the_link_down_unless_uploads_outrun_backward(down, up):
    """The copy queue's speed ([Note: the copy queue]): the forward's copies down, each under one
    block forward; an upload runs under a block's backward, ``UPLOAD_FORWARDS`` forwards, so
    the speed falls below the downward one only where the uploads could not keep to it."""
    speed = recompute_plan.queue_speed(down, up)
    assert speed <= down
    assert 1 / up <= recompute_plan.UPLOAD_FORWARDS / speed * (1 + 1e-12)  # an upload fits
    assert speed == down or speed == recompute_plan.UPLOAD_FORWARDS * up


def test_a_slower_upward_link_costs_the_14b_plan_no_blocks():
    """qwen3-14b's shapes on an H100 whose probe read 41.8 GB/s one way and whose forward's
    copies ran at 53.1 GB/s (benches/results/onepath14.md): counted at the slower direction,
    the plan offloads 17 blocks (as that H100 ran), at the downward link's 21 (22 at the 54.9
    GB/s of an earlier call's probe); an upward link that slow still keeps up with backward, so
    the plan is the downward link's."""
    lv = (RegionLevel("recompute", 0, 0.0135), RegionLevel("selective", 1_711_276_032, 0.002),
          RegionLevel("keep", 2_820_000_000, 0.0))

    def offloaded(speed: float) -> int:
        link = HostLink(speed, 0.0177, 64 * GiB, tail_forwards=3.7)
        return len(plan_block_levels(lv, 40, 0, link, reserve_room_bytes=8 * GiB,
                                     tail_room_bytes=8 * GiB).offloaded)

    assert recompute_plan.queue_speed(53.1e9, 41.8e9) == 53.1e9
    assert (offloaded(41.8e9), offloaded(53.1e9), offloaded(54.9e9)) == (17, 21, 22)


def test_at_qwen3_14b_shapes_the_link_carries_more_blocks_at_selective():
    """The default at issue 36's setup (qwen3-14b as rank 0 of 8 on 80 GiB, the user's fp32 loss
    outside the model: no room on the device, 8 GiB under the step's peak for the reserve), a
    47.6 GB/s host link and a 20 ms block forward (benches/results/onepath14.md): a block's
    copy at "keep" (2.82 GB) is modelled at 3.1 block forwards, at "selective" (1.58 GB, the
    matmul and attention outputs) 1.75 (at ``LINK_SHARE`` of the link's speed), so "selective"
    offloads 21 blocks where "keep" would offload 12, and saves more recompute though each of
    its blocks still recomputes the elementwise ops. With three calls on their way the link
    runs without a gap ([Note: the copy queue]): every other block would offload 19."""
    lv = (RegionLevel("recompute", 0, 0.0135), RegionLevel("selective", 1_580_000_000, 0.002),
          RegionLevel("keep", 2_820_000_000, 0.0))
    link = HostLink(47.6e9, 0.020, 64 * GiB)
    plan = plan_block_levels(lv, 40, 0, link, reserve_room_bytes=8 * GiB)
    assert plan.copy_queue == recompute_plan.CopyQueue(
        (1, 2, 3, 5, 7, 8, 10, 12, 14, 15, 17, 19, 21, 22, 24, 26, 28, 29, 31, 33, 35),
        in_flight=3, drained_at=39, upload_ahead=2)
    assert set(plan.levels[b] for b in plan.offloaded) == {1} and plan.levels.count(0) == 19
    assert plan.saved_seconds == pytest.approx(21 * 0.0115)
    assert_copies_never_wait(plan.copy_queue, plan.offload_block_bytes, link, 40)
    keep = recompute_plan._offloaded_at(2, lv, 40, 0, link, 8 * GiB, None,
                                        plan_block_levels(lv, 40, 0))
    assert len(keep.offloaded) == 12 and keep.saved_seconds == pytest.approx(12 * 0.0135)
    assert keep.saved_seconds < plan.saved_seconds
    # Room for two calls on their way only: every other block, the last copy drained by the
    # last block (the plan the H200 ran at f92bee3 drained it one block later than its copy
    # ended: 12.5 ms a step exposed).
    two = plan_block_levels(lv, 40, 0, link, reserve_room_bytes=2 * 1_580_000_000)
    assert two.offloaded == tuple(range(0, 37, 2)) and two.copy_queue.in_flight == 2
    assert_copies_never_wait(two.copy_queue, two.offload_block_bytes, link, 40)
    # Room for the reserve through the last block to the model's output too, which comes three
    # block forwards after the last block begins (its output projection's matmul, about two):
    # the queue drains there, and the link carries two more blocks.
    tail = link._replace(tail_forwards=3.0)
    out = plan_block_levels(lv, 40, 0, tail, reserve_room_bytes=8 * GiB, tail_room_bytes=8 * GiB)
    assert len(out.offloaded) == 23 and out.offloaded[-1] == 37
    assert out.copy_queue.drained_at == 40 and out.copy_queue.in_flight == 3
    assert_copies_never_wait(out.copy_queue, out.offload_block_bytes, tail, 40)
    # Where the room there holds two calls' bytes only, three on their way drained at a block
    # carry more than two drained at the output.
    assert plan_block_levels(lv, 40, 0, tail, reserve_room_bytes=8 * GiB,
                             tail_room_bytes=2 * 1_580_000_000).copy_queue == plan.copy_queue
    # Under "auto", 8.9 GiB of room on the device beside the reserve, a 40 GB/s link and a 30 ms
    # forward: "selective" offloads 29 blocks, nearly four of every five, and keeps the last 3 on
    # the device (288 ms saved, where two calls on their way offloaded every other block).
    lv = (RegionLevel("recompute", 0, 0.013), RegionLevel("selective", int(1.4 * GiB), 0.004),
          RegionLevel("keep", int(2.3 * GiB), 0.0))
    link = HostLink(40e9, 0.030, 64 * GiB)
    plan = plan_block_levels(lv, 40, int(8.9 * GiB), link)
    assert len(plan.offloaded) == 29 and plan.copy_queue.in_flight == 3
    assert plan.levels[37:] == (1, 1, 1) and plan.offloaded[-1] == 36
    assert plan.saved_seconds == pytest.approx(32 * 0.009)
    assert plan.modelled_peak_bytes <= 8.9 * GiB
    assert_copies_never_wait(plan.copy_queue, plan.offload_block_bytes, link, 40)
    # A host with room for 4 blocks at "keep" holds 6 at "selective": the last ones.
    small = plan_block_levels(lv, 40, int(8.9 * GiB), link._replace(host_bytes=int(4 * 2.3 * GiB)))
    assert small.offloaded == (25, 27, 29, 31, 33, 35)


def _cpu_link(copies: float, host_below_keep: bool = False):
    """A stand-in for ``BlockReplanner._rank_host_link`` on the CPU, which has no host link: one
    block's copy at "keep" is modelled to take ``copies`` blocks' forward (at ``LINK_SHARE`` of
    the link's speed), and the host holds every block (``host_below_keep``: less than one block
    at "keep")."""

    def link(self):
        nbytes = self.frames.estimate.levels[2].extra_bytes
        host = nbytes - 1 if host_below_keep else 1 << 40
        # Whole bytes a second, as the ranks agree it: a copy of no more than ``copies``.
        return HostLink(math.ceil(nbytes / (LINK_SHARE * copies * 1e-3)), 1e-3, host)

    return link


def _reserve_only(lv, n):
    """Room for two blocks on their way to the host, and nothing else."""
    return 2 * lv[2].extra_bytes


class Trained(NamedTuple):
    losses: list
    params: dict
    frames: object
    pool: object
    memory: object
    peaks: list
    """Each step's allocated peak above what was allocated when the run began (CUDA only)."""
    reserved: list
    """Each step's peak of torch's reserved memory above what was reserved when the run began,
    its cache emptied (CUDA only)."""
    compiled: object

    def rise(self, peaks: list) -> list:
        """``peaks`` (``self.peaks`` or ``self.reserved``) above step 0's, from step 2 on. Step
        0 offloads nothing: two runs that differ only in what they offload compare from there,
        which takes out what differs between the first and the second run of a process (the
        second reuses free room in the segments of what the first still holds)."""
        return [p - peaks[0] for p in peaks[2:]]


def _room_under_the_peak(rise: int = 0):
    """A stand-in for ``block_replan.reserve_ceiling`` where the profile cannot see activations
    (the CPU): the profile's own peak, ``rise`` more from the second profile on (the steady
    step's), and room under it for any reserve."""
    seen = []

    def ceiling(profile):
        seen.append(profile)
        peak = max((*profile.forward, *profile.backward))
        return block_replan.ReserveRoom(peak + (rise if len(seen) > 1 else 0), 1 << 40, 1 << 40)

    return ceiling


def _train(monkeypatch, init, copies, steps, *, to_host=True, device="cpu",
           batches=None, recompute="auto", ceiling=None, host_below_keep=False,
           inner="aot_eager", loss_of=decoder_loss, payback_steps=EVERY_COMPILE_PAYS,
           real_link: bool = False) -> Trained:
    """``init`` sharded on ``device``, compiled under blocks with its optimizer and the host
    link ``_cpu_link(copies)`` (None: no link), trained on ``batches`` (default: ``steps`` tiny
    ones), each step's loss ``loss_of(compiled, tokens)``; with
    ``to_host`` False, the blocks the plan offloads keep their activations on the device.
    ``recompute="auto"``: the room ``_reserve_only`` at the grow and settle; the default
    (``"checkpointed"``): the step's own peak read by ``ceiling`` (default: the real
    ``reserve_ceiling``, on CUDA), its re-plan's compile paid for in ``payback_steps`` (default:
    whatever the tiny blocks save, [Note: a re-plan's compile pays for itself]); ``real_link``:
    the rank's own link as measured (CUDA), ``copies`` unused."""
    if not real_link:
        monkeypatch.setattr(block_replan.BlockReplanner, "_rank_host_link",
                            _cpu_link(copies, host_below_keep) if copies else lambda self: None)
    if ceiling is not None:
        monkeypatch.setattr(block_replan, "reserve_ceiling", ceiling)
    if not to_host:
        monkeypatch.setattr(block_offload.BlockOffload, "start",
                            lambda self, block, args, kwargs: None)
    torch._dynamo.reset()
    gc.collect()
    # A caller comparing two runs still holds the first (its model, optimizer state and
    # parameters): each run's peaks are measured from where it began, not from zero.
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    began = ((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if device == "cuda"
             else (0, 0))
    model = shard(copy.deepcopy(init).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm = zbuf.compile(model, inner=inner, structure="blocks", recompute=recompute,
                      fullgraph=True, optimizer=opt, replan_payback_steps=payback_steps)
    if recompute == "auto":
        clamp_room(zbuf.compile.step_memory_of(cm), _reserve_only, _reserve_only)
    data = [t.to(device) for t in (batches if batches is not None else token_batches(steps))]
    losses = train_adamw(cm, model, data, opt, loss_of=loss_of)
    monkeypatch.undo()
    # zbuf's meter owns the device's peak counters and resets them at every phase ([Note:
    # phase peaks] in zbuf/memory/phases.py): a step's peak is the largest of its row's phases.
    memory = zbuf.compile.step_memory_of(cm)
    memory.close_step()
    steps = [row.phases for row in memory.rows] if device == "cuda" else []
    peaks = [s.allocated_peak_bytes - began[0] for s in steps]
    reserved = [s.reserved_peak_bytes - began[1] for s in steps]
    return Trained(losses, full_state_dict(model), block_frames_of(model), root_of(model).pool,
                   memory, peaks, reserved, cm)


@pytest.mark.parametrize("copies,expected,level,upload_ahead", [
    (1, [0, 1, 2, 3, 4, 5], 2, 1),
    # A copy at "keep" takes two blocks' forward: every other block offloaded at "keep" saves
    # more modelled recompute (3 x 0.18 us) than "selective" does, whose copy takes under one
    # (four blocks offloaded and three kept selective beside their reserve: 7 x 0.07 us).
    (2, [0, 2, 4], 2, 2)])
def test_offloaded_blocks_train_as_the_reference_and_as_the_same_blocks_kept(
        monkeypatch, copies, expected, level, upload_ahead):
    """Seven blocks, room for two on their way to the host only (or two kept on the device),
    a block's copy at "keep" taking ``copies`` blocks' forward: the re-plan after the measured
    step offloads the blocks at ``level`` that the copy queue fits ([Note: the copy queue]),
    which saves more recompute than keeping two. Losses and
    parameters match the unsharded reference (1e-5) and, bit for bit, the same plan with those
    blocks' activations kept on the device; every byte sent to the host comes back once per
    step, each call's upload starts before its backward, and no copy outlives its step."""
    steps = 4
    init = decoder(7)
    run = _train(monkeypatch, init, copies, steps)
    losses, params, frames, pool = run.losses, run.params, run.frames, run.pool
    offload = frames.offload
    plan = frames.levels, offload.report()["blocks"]
    assert offload.report()["blocks"] == expected and offload.queue.upload_ahead == upload_ahead
    assert [frames.levels.get(b, 0) == level for b in frames.called] == [
        i in expected or level == 1 for i in range(7)]
    # Offloaded from step 1 on (the re-plan came at its forward), the same bytes every step.
    assert offload.moved_down == offload.moved_up > 0
    assert offload.moved_down % (steps - 1) == 0
    assert offload.late_uploads == 0
    assert offload.forwards == steps - 1  # the host has no copies to wait for, nor to time
    assert offload.report()["exposed_ms_per_step"] == 0.0
    assert offload.report()["exposed_ms_per_step_by_wait"] == {
        "throttle": 0.0, "drain": 0.0, "upload": 0.0}
    assert offload.report()["measured_copy_ms"] is None
    assert offload.report()["measured_copy_bytes_per_second"] is None
    assert frames.schedule()["measured_block_forward_ms"] is None
    # Every host copy went to its position's arena, of the plan's estimate of a block's bytes.
    report = offload.report()
    assert report["unplanned_host_bytes"] == 0
    per_call = offload.moved_down // (steps - 1) // len(expected)
    assert per_call <= report["host_arena_bytes"] // len(expected) <= 2 * per_call
    gc.collect()
    assert len(offload._calls) == 0
    assert pool.stats().checked_out == 0

    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, token_batches(steps),
                             torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    ref_sd = ref.state_dict()
    assert max(rel_err(params[k], ref_sd[k]) for k in ref_sd) <= 1e-5

    kept = _train(monkeypatch, init, copies, steps, to_host=False)
    kept_losses, kept_params, kept_frames = kept.losses, kept.params, kept.frames
    assert (kept_frames.levels.values().__len__(), kept_frames.offload.report()["blocks"]) == (
        len(plan[0]), plan[1])
    assert kept_frames.offload.moved_down == 0
    assert kept_losses == losses
    assert all(torch.equal(kept_params[k], params[k]) for k in params)


@pytest.mark.parametrize("copies,small_host,level,expected", [
    (1, False, 2, [0, 1, 2, 3, 4, 5]),
    # A copy at "keep" takes three forwards; at "selective" (under half the bytes) fewer, and
    # three calls on their way let it offload five blocks.
    (3, False, 1, [0, 1, 2, 3, 4]),
    # A host that holds less than one block at "keep" holds two at "selective".
    (1, True, 1, [4, 5])])
def test_the_default_offloads_under_its_own_peak_as_the_reference_and_the_blocks_kept(
        monkeypatch, copies, small_host, level, expected):
    """``zbuf.compile``'s default ([Note: offloaded under the step's own peak] in
    block_replan.py): with the measured step's peak leaving room for the reserve, the blocks
    the copy queue fits go to the host at ``level``, and every other block stays at the
    user's checkpointing, none kept on the device (a block's copy at "keep" taking ``copies``
    blocks' forward). Losses and parameters
    match the unsharded reference (1e-5) and, bit for bit, the same blocks kept on the device;
    the record names the mode and the offloaded blocks."""
    steps = 4
    init = decoder(7)
    run = _train(monkeypatch, init, copies, steps, recompute="checkpointed",
                 ceiling=_room_under_the_peak(), host_below_keep=small_host)
    frames, offload = run.frames, run.frames.offload
    assert offload.report()["blocks"] == expected
    assert [frames.levels.get(b, 0) for b in frames.called] == [
        level if i in expected else 0 for i in range(7)]
    assert offload.moved_down == offload.moved_up > 0 and offload.late_uploads == 0
    # The step's progress saw the uploads in backward (the window uploads after them: [Note:
    # the step's window] in zbuf/offload_window.py).
    assert run.memory.progress.link_busy_until >= 0
    levels = run.memory.report()["measured"]["recompute"]
    assert levels["mode"] == "checkpointed"
    at_level = levels["regions_kept" if level == 2 else "regions_selective"]
    assert (levels["regions_offloaded"], at_level) == (len(expected), len(expected))
    assert run.memory.steady is not None and not run.memory.steady.replanned
    # Its arenas were locked ahead of the plan, as many as it took ([Note: arenas locked
    # ahead] in block_offload.py: the room here leaves the prediction's unbounded one's blocks),
    # unless the host holds less than a block at "keep": the optimizer's state, which step 0
    # may still send there, takes that room ahead of the plan.
    report = offload.report()
    if small_host:
        assert report["arenas_locked_ahead"] == 0
    else:
        assert report["arenas_locked_ahead"] == report["arenas_taken_ahead"] == len(expected)
        assert report["unlocked_host_bytes"] == 0

    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, token_batches(steps),
                             torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(run.losses, ref_losses, rtol=1e-5, atol=0)
    kept = _train(monkeypatch, init, copies, steps, to_host=False, recompute="checkpointed",
                  ceiling=_room_under_the_peak(), host_below_keep=small_host)
    assert [kept.frames.levels.get(b, 0) for b in kept.frames.called] == [
        frames.levels.get(b, 0) for b in frames.called]
    assert kept.frames.offload.moved_down == 0
    assert kept.losses == run.losses
    assert all(torch.equal(kept.params[k], run.params[k]) for k in run.params)


def test_a_plan_takes_its_arenas_from_those_locked_ahead():
    """[Note: arenas locked ahead]: the first plan takes, in order, as many of the arenas locked
    ahead as its positions need, and locks its own where those are too few or too small; the
    rest are dropped; locking ahead happens once, before any plan."""
    from concurrent.futures import wait

    def arenas(offload):
        wait(offload._arenas.values())
        return offload.report()

    offload = block_offload.BlockOffload(torch.device("cpu"))
    offload.lock_ahead(4096, 3)
    ahead = list(offload._ahead)
    offload.plan({b: b for b in range(6)}, recompute_plan.CopyQueue((1, 3), 2, 4, 1), 4096)
    assert [offload._arenas[p] for p in (1, 3)] == ahead[:2] and not offload._ahead
    report = arenas(offload)
    assert (report["arenas_locked_ahead"], report["arenas_taken_ahead"]) == (3, 2)
    assert report["host_arena_bytes"] == 2 * block_offload.arena_bytes(4096)
    offload.lock_ahead(4096, 3)
    offload.plan({b: b for b in range(6)}, recompute_plan.CopyQueue((0, 1, 3), 2, 4, 1), 4096)
    report = arenas(offload)
    assert (report["arenas_locked_ahead"], report["arenas_taken_ahead"]) == (3, 2)
    assert report["host_arena_bytes"] == 3 * block_offload.arena_bytes(4096)

    small = block_offload.BlockOffload(torch.device("cpu"))
    small.lock_ahead(1024, 2)
    small.plan({b: b for b in range(6)}, recompute_plan.CopyQueue((1, 3), 2, 4, 1), 4096)
    report = arenas(small)
    assert (report["arenas_locked_ahead"], report["arenas_taken_ahead"]) == (2, 0)
    assert report["host_arena_bytes"] == 2 * block_offload.arena_bytes(4096)


def test_the_arenas_locked_ahead_leave_room_for_the_state_step_0_may_offload(monkeypatch):
    """Locked before step 0's optimizer step, which may still put the optimizer's state in host
    memory, the arenas locked ahead fit in half the host share less half of that state ([Note:
    arenas locked ahead] in block_offload.py): with a share of the state and half a block, none
    is locked ahead, and the plan, made once the state stayed on the device, offloads its
    blocks all the same (their arenas locked then); with nothing left to decide, the same share
    locks them ahead."""
    from zbuf.offload_choice import OffloadChoice

    init = decoder(7)
    state = OffloadChoice(torch.optim.AdamW(init.parameters()), torch.device("cpu"),
                          None).undecided_host_bytes()
    assert state > 0

    def link(self):
        estimate = self.frames.estimate
        smallest = min(lv.extra_bytes for lv in estimate.levels[1:]) + (
            estimate.moved_beside_level_bytes)
        keep = estimate.levels[2].extra_bytes + estimate.moved_beside_level_bytes
        return HostLink(math.ceil(keep / (LINK_SHARE * 2 * 1e-3)), 1e-3,
                        state // 2 + smallest // 2)

    def offload():
        monkeypatch.setattr(block_replan.BlockReplanner, "_rank_host_link", link)
        return _train(monkeypatch, init, 2, 4, recompute="checkpointed",
                      ceiling=_room_under_the_peak(), real_link=True).frames.offload.report()

    pending = offload()
    assert pending["arenas_locked_ahead"] == 0 and pending["blocks"], pending
    assert pending["unplanned_host_bytes"] == 0
    monkeypatch.setattr(OffloadChoice, "undecided_host_bytes", lambda self: 0)
    decided = offload()
    assert decided["blocks"] == pending["blocks"]
    assert decided["arenas_locked_ahead"] == decided["arenas_taken_ahead"] == len(
        decided["blocks"])
    assert OffloadChoice(torch.optim.AdamW(init.parameters()), torch.device("cpu"),
                         True).undecided_host_bytes() == 0


def test_the_default_gives_its_offload_up_when_the_steady_step_peaks_higher(monkeypatch):
    """The steady step peaks above the measured one by more than the tolerance: the settle puts
    every block back at the user's checkpointing (no compile: level 0's frame is there), and
    training goes on as the reference."""
    steps = 5
    init = decoder(7)
    run = _train(monkeypatch, init, 2, steps, recompute="checkpointed",
                 ceiling=_room_under_the_peak(rise=1 << 30))
    memory = run.memory
    assert memory.measured.recompute["regions_offloaded"] == 3
    assert memory.steady.replanned and not memory.steady.recompiled
    assert memory.steady.recompute["regions_offloaded"] == 0
    assert run.frames.levels == {} and not run.frames.offload.offloaded
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, token_batches(steps),
                             torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(run.losses, ref_losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize("copies,small_host,level,expected,frames_compiled,dropout,inner", [
    (1, False, 2, [0, 1, 2, 3, 4, 5], 2, 0.0, "aot_eager"),
    # A copy at "keep" takes 3.9 blocks' forward: at "selective" (about half its bytes) the
    # queue carries every second block, in the frame level 0 runs (no compile at the re-plan).
    (3.9, False, 1, [0, 2, 4], 1, 0.0, "aot_eager"),
    # Inductor's joint graph of the block models its recompute dearer (66 ns against 53): one
    # block at "keep" saves more than three at "selective", its frame compiled at the re-plan.
    (3.9, False, 2, [2], 2, 0.0, "inductor"),
    # Dropout in attention, recomputed from its replayed RNG state at "selective": a host that
    # holds less than one block at "keep" makes it the level, two blocks.
    (1, True, 1, [4, 5], 1, 0.1, "aot_eager")])
def test_blocks_under_the_parents_checkpoint_offloaded(monkeypatch, copies, small_host, level,
                                                       expected, frames_compiled, dropout,
                                                       inner):
    """The issue's user script: the parent wraps each block call in a non-reentrant checkpoint
    ([Note: a block under the caller's checkpoint] in zbuf/compile/block_frames.py). The
    default plans those blocks too: level 0 is the parent's recompute, through the frame
    compiled at "selective" (so "selective", where a slower link makes fewer bytes pay, compiles
    nothing more), "keep" a frame of its own that the plan compiles when the link carries its
    bytes, and an offloaded block's frame saves
    under zbuf's own hooks, so the parent's checkpoint keeps nothing of it and never
    recomputes it.
    Losses and parameters match the unsharded reference (1e-5) and, bit for bit, the same
    blocks kept on the device; the frames ran no block's forward in backward but the others'."""
    from test_user_checkpointing import VOCAB, Decoder

    from zbuf.compile.block_frames import BlockFrames
    from zbuf.runtime import in_backward

    steps = 4
    torch.manual_seed(0)
    init = Decoder("parent", layers=7, dropout=dropout)
    batches = token_batches(steps, vocab=VOCAB)
    recomputed: list[list[int]] = []
    """Per step, the blocks (by first-call order) the frames ran in backward."""
    run_block = BlockFrames.run

    def counting(self, slot, block, args, kwargs):
        if in_backward():
            recomputed[-1].append(list(self.called).index(id(block)))
        elif not self.called or next(iter(self.called)) == id(block):
            recomputed.append([])  # a forward's first block: a new step
        return run_block(self, slot, block, args, kwargs)

    def trained(to_host):
        recomputed.clear()
        monkeypatch.setattr(BlockFrames, "run", counting)
        torch.manual_seed(1)  # dropout's draws, alike in every run
        return _train(monkeypatch, init, copies, steps, to_host=to_host, batches=batches,
                      recompute="checkpointed", ceiling=_room_under_the_peak(),
                      host_below_keep=small_host, inner=inner)

    run = trained(True)
    frames, offload = run.frames, run.frames.offload
    assert frames.callers_checkpoint
    assert offload.report()["blocks"] == expected
    assert [frames.levels.get(b, 0) for b in frames.called] == [
        level if i in expected else 0 for i in range(7)]
    # "selective" is the parent-checkpointed frame itself; "keep" is compiled at the re-plan.
    assert frames.graphs_compiled == frames_compiled
    assert offload.moved_down == offload.moved_up > 0 and offload.late_uploads == 0
    per_call = offload.moved_down // (steps - 1) // len(expected)
    # Each call moves what its level's estimate says: at "selective" its matmul and attention
    # outputs (the log-sum-exp among them) and, with dropout, the RNG state its replay keeps
    # (the CPU generator's 5056 bytes; CUDA's is 16); at "keep" no more than the estimate,
    # which counts every value backward reads.
    estimated = frames.estimate.levels[level].extra_bytes
    if level == LEVELS.index("selective"):
        rng = torch.get_rng_state().numel() if dropout else 0
        assert per_call == estimated + rng, (per_call, frames.estimate.levels)
    else:
        assert estimated * 3 // 4 <= per_call <= estimated, (per_call, frames.estimate.levels)
    # Step 0 (before the plan) recomputes every block; from step 1 on only those kept at the
    # parent's checkpoint.
    assert sorted(recomputed[0]) == list(range(7))
    assert all(sorted(r) == [i for i in range(7) if i not in expected]
               for r in recomputed[1:steps]), recomputed
    ref = copy.deepcopy(init)
    torch.manual_seed(1)
    ref_losses = train_adamw(ref, ref, batches, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(run.losses, ref_losses, rtol=1e-5, atol=0)
    kept = trained(False)
    assert kept.frames.offload.moved_down == 0
    assert kept.losses == run.losses
    assert all(torch.equal(kept.params[k], run.params[k]) for k in run.params)


def test_the_parents_selective_frame_saves_what_the_blocks_own_checkpoint_would(monkeypatch):
    """zbuf's tags on a parent-checkpointed block ([Note: a block under the caller's checkpoint]
    in zbuf/compile/block_frames.py) make the "selective" frame the user's checkpoint inside the
    block makes: the same level estimates, the same blocks offloaded, the same bytes moved."""
    from test_user_checkpointing import VOCAB, Decoder

    def offloaded(placement):
        torch.manual_seed(0)
        run = _train(monkeypatch, Decoder(placement, layers=7), 3.9, 3,
                     batches=token_batches(3, vocab=VOCAB), recompute="checkpointed",
                     ceiling=_room_under_the_peak())
        offload = run.frames.offload
        assert set(run.frames.levels.values()) == {LEVELS.index("selective")}
        return run.frames.estimate.levels, offload.report()["blocks"], offload.moved_down

    assert offloaded("parent") == offloaded("inside")


@pytest.mark.parametrize("placement", ["inside", "parent"])
def test_a_query_wider_than_the_hidden_size_moves_what_the_plan_sized(monkeypatch, placement):
    """qwen3-32b's attention is wider than its hidden size (64 heads of 128 against 5120): each
    offloaded call's arena is the plan's estimate of what it moves, and the estimate had counted
    the down projection's output (read by no backward op, only returned) in place of the
    attention's output and its log-sum-exp, which differ from it only where the query's width
    is not the hidden size. At 32B that left 105 MB a call out of its arena
    (benches/results/onepath32b.md): each call moves exactly the estimate, all of it in its
    arena."""
    import test_user_checkpointing
    from test_user_checkpointing import HEAD_DIM, HIDDEN, VOCAB, Decoder

    monkeypatch.setattr(test_user_checkpointing, "HEADS", 2 * HIDDEN // HEAD_DIM)
    steps = 3
    torch.manual_seed(0)
    init = Decoder(placement, layers=7)
    run = _train(monkeypatch, init, 1, steps, batches=token_batches(steps, vocab=VOCAB),
                 recompute="checkpointed", ceiling=_room_under_the_peak(), host_below_keep=True)
    offload = run.frames.offload
    report = offload.report()
    assert report["blocks"] and set(run.frames.levels.values()) == {LEVELS.index("selective")}
    assert offload.moved_down // (steps - 1) // len(report["blocks"]) == (
        report["planned_block_bytes"])
    assert report["unplanned_host_bytes"] == 0


def test_blocks_under_their_own_selective_checkpoint_move_what_the_plan_sized(monkeypatch):
    """The user's selective checkpoint inside each block (torchtitan's op-level policy, as
    ``--placement selective`` in benches/plain_setup.py runs it): level 0 saves the policy's
    matmul and attention outputs, and an offloaded call moves those beside what its level
    keeps beyond them. The plan sizes the calls' arenas and copies by both, so every byte
    each offloaded call moves is the plan's estimate (none through torch's pinned tensors),
    and training matches the unsharded reference (1e-5)."""
    from torch.utils.checkpoint import checkpoint
    from test_user_checkpointing import VOCAB, Block, Decoder

    from zbuf.models import selective_checkpoint_context

    class SelectiveBlock(Block):
        def forward(self, x, cos, sin):
            return checkpoint(self._body, x, cos, sin, use_reentrant=False,
                              context_fn=selective_checkpoint_context)

    steps = 3
    torch.manual_seed(0)
    init = Decoder("none", layers=7)
    init.layers = torch.nn.ModuleList(SelectiveBlock("none", 0.0, True) for _ in range(7))
    batches = token_batches(steps, vocab=VOCAB)
    run = _train(monkeypatch, init, 1, steps, batches=batches, recompute="checkpointed",
                 ceiling=_room_under_the_peak(), host_below_keep=True)
    frames, offload = run.frames, run.frames.offload
    report = offload.report()
    assert not frames.estimate.whole and frames.estimate.saved_bytes > 0
    assert report["blocks"] and set(frames.levels.values()) == {LEVELS.index("selective")}
    per_call = offload.moved_down // (steps - 1) // len(report["blocks"])
    # The level's estimate is what the call moves: not the down projection's output, which no
    # backward op reads (the block's output is not saved).
    assert per_call == report["planned_block_bytes"]
    assert report["unplanned_host_bytes"] == 0
    ref = copy.deepcopy(init)
    ref_losses = train_adamw(ref, ref, batches, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(run.losses, ref_losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize("placement", ["inside", "parent"])
def test_the_default_offloads_only_where_the_saving_pays_for_the_compile(monkeypatch, placement):
    """[Note: a re-plan's compile pays for itself]: the tiny blocks' offload saves microseconds a
    step. The inside placement's "selective" frame is not compiled: within the default's 100
    steps that never pays for the first step's seconds, so every block stays at the user's
    checkpointing, nothing compiled at the re-plan, and the record says what was declined;
    within a horizon long enough, the same plan is taken. The parent placement's frame is
    compiled at "selective" from the first step, so its plan compiles nothing and is taken
    whatever the horizon."""
    from test_user_checkpointing import VOCAB, Decoder

    batches = token_batches(3, vocab=VOCAB)

    def run(payback_steps):
        torch.manual_seed(0)
        return _train(monkeypatch, Decoder(placement, layers=7), 3.9, 3, batches=batches,
                      recompute="checkpointed", ceiling=_room_under_the_peak(),
                      payback_steps=payback_steps)

    declined = run(100)
    offload = declined.frames.offload
    taken = run(EVERY_COMPILE_PAYS)
    assert taken.frames.offload.offloaded and taken.frames.offload.declined_for_compile is None
    assert set(taken.frames.levels.values()) == {LEVELS.index("selective")}
    ahead = taken.frames.offload.report()
    assert ahead["arenas_locked_ahead"] == ahead["arenas_taken_ahead"] == len(ahead["blocks"])
    if placement == "parent":
        assert offload.report()["blocks"] == taken.frames.offload.report()["blocks"]
        assert offload.declined_for_compile is None
        return
    # Declined before the step ended, when its arenas would have been locked ahead ([Note:
    # arenas locked ahead] in block_offload.py): none was.
    assert offload.report()["arenas_locked_ahead"] == 0
    assert not offload.offloaded and declined.frames.levels == {}
    assert not declined.memory.measured.replanned
    record = offload.report()["declined_for_compile"]
    assert record["blocks"] == len(taken.frames.offload.offloaded)
    assert 0 < record["saved_ms_per_step"] * 100 < 1e3 * record["first_step_s"]
    assert record["payback_steps"] == 100
    assert record["levels"] == {"selective": len(taken.frames.levels)}
    assert declined.frames.graphs_compiled < taken.frames.graphs_compiled
    torch.testing.assert_close(declined.losses, taken.losses, rtol=1e-5, atol=0)


def test_the_default_without_room_under_its_peak_offloads_nothing(monkeypatch):
    """On the CPU stand-in the profile sees no activations, so the measured step's peak is its
    gradients' end of backward, and the reserve finds no room under it: nothing offloaded,
    every block at the user's checkpointing, even with a host link."""
    run = _train(monkeypatch, decoder(7), 1, 3, recompute="checkpointed")
    assert not run.frames.offload.offloaded and run.frames.levels == {}
    assert run.memory.measured.recompute["regions_offloaded"] == 0


def test_the_reserve_has_the_room_under_the_peak_where_it_is_live():
    """The forward's block segments but the last block's, and backward's after its first (the
    loss and the start of backward, where the step peaks): the room is the peak less the
    highest of them; a backward with one segment counts it. Live to the model's output, the
    last block's segment counts too (there the output projection's logits are live)."""
    profile = StepProfile(0, (10, 20, 30, 40, 90), (100, 50, 45), 70)
    assert block_replan.reserve_ceiling(profile) == (100, 50, 10)
    assert block_replan.reserve_ceiling(profile._replace(backward=(100,))) == (100, 0, 0)
    assert block_replan.reserve_ceiling(profile._replace(forward=(10, 120))) == (120, 70, 0)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(levels_and_link(), st.integers(0, 24), st.integers(-(1 << 10), 1 << 16),
       st.integers(0, 1 << 16), st.one_of(st.none(), st.integers(0, 1 << 16)),
       st.sampled_from([0, 1, 1 << 10, 1 << 12]))
def test_offloaded_blocks_apart_from_the_peak_keep_the_device_plan_and_fit_their_own_room(
        levels_link, blocks, room, reserve_room, tail_room, saved):
    """With the reserve's room apart: the blocks not offloaded have the levels of the plan in
    ``room`` alone, the reserve fits its own room and is not in the modelled peak, it drains at
    the model's output only where it fits the room there too, its copies (level 0's saves
    among them) never wait, and the offload is taken only when it saves time."""
    lv, link = levels_link
    on_device = plan_block_levels(lv, blocks, room)
    plan = plan_block_levels(lv, blocks, room, link, reserve_room_bytes=reserve_room,
                             tail_room_bytes=tail_room, moved_beside_bytes=saved)
    if not plan.offloaded:
        assert plan == on_device
        return
    assert plan.reserve_apart
    assert plan.offload_block_bytes == plan.offload_extra_bytes + saved
    assert len(plan.offloaded) * plan.offload_block_bytes <= link.host_bytes
    assert plan.offload_reserve_bytes == plan.copy_queue.in_flight * plan.offload_extra_bytes
    assert plan.offload_reserve_bytes <= reserve_room
    if plan.copy_queue.drained_at == blocks:
        assert tail_room is not None and plan.offload_reserve_bytes <= tail_room
    assert_copies_never_wait(plan.copy_queue, plan.offload_block_bytes, link, blocks)
    assert plan.modelled_peak_bytes == on_device.modelled_peak_bytes <= max(room, 1)
    assert [lv_ for b, lv_ in enumerate(plan.levels) if b not in plan.offloaded] == [
        lv_ for b, lv_ in enumerate(on_device.levels) if b not in plan.offloaded]
    assert all(on_device.levels[b] == 0 for b in plan.offloaded)
    assert plan.saved_seconds > on_device.saved_seconds


def test_the_record_says_which_blocks_went_to_the_host(monkeypatch):
    """The re-plan's levels in the step memory's report count the offloaded blocks, and the
    frames' schedule names them with the bytes moved."""
    run = _train(monkeypatch, decoder(7), 2, 3)
    frames, memory = run.frames, run.memory
    levels = memory.report()["measured"]["recompute"]
    # Every other block kept and offloaded (the first test's second case).
    assert (levels["regions_offloaded"], levels["regions_selective"], levels["regions_kept"]) == (
        3, 0, 3)
    schedule = frames.schedule()
    assert schedule["activation_offload"]["blocks"] == [0, 2, 4]
    assert schedule["activation_offload"]["moved_down_bytes"] > 0


def test_two_forwards_before_one_backward_upload_on_demand_and_match_the_kept_blocks(
        monkeypatch):
    """Accumulation written as two forwards and one backward of their sum: the second
    forward's calls take the positions the backward reaches first, so the first forward's
    calls upload when their backward unpacks them (counted late), with the same gradients,
    bit for bit, as the same blocks kept on the device."""
    grads = []
    late = []
    for to_host in (True, False):
        run = _train(monkeypatch, decoder(7), 1, 3, to_host=to_host)
        if not to_host:
            monkeypatch.setattr(block_offload.BlockOffload, "start",
                                lambda self, block, args, kwargs: None)
        from zbuf.models import loss

        first, second = token_batches(2)
        before = run.frames.offload.late_uploads
        total = (loss(run.compiled, first[:, :-1], first[:, 1:])
                 + loss(run.compiled, second[:, :-1], second[:, 1:]))
        total.backward()
        monkeypatch.undo()
        late.append(run.frames.offload.late_uploads - before)
        # The second forward's calls found their positions' arenas holding the first's copies.
        assert (run.frames.offload.unplanned_host_bytes > 0) == to_host
        grads.append([p.grad.clone() for p in run.compiled.parameters()])
    assert late[0] > 0 and late[1] == 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_calls_inputs_stay_on_the_device_and_its_own_tensors_go():
    """The call's positional and keyword inputs (a Hugging Face layer's rotary tables come as
    ``position_embeddings=(cos, sin)``, every layer's) and views that are not their whole
    storage stay where they are; a tensor the block made goes to host memory and comes back
    equal."""
    offload = block_offload.BlockOffload(torch.device("cpu"))
    offload.plan({7: 0}, recompute_plan.CopyQueue((0,), 2, 1, 1))
    x, cos, sin = torch.randn(4, 8), torch.randn(4, 2), torch.randn(4, 2)
    assert offload.start(8, (x,), {}) is None  # not offloaded
    call = offload.start(7, (x,), {"position_embeddings": (cos, sin)})
    made = torch.randn(4, 8)
    assert call.pack(x) is x and call.pack(cos) is cos and call.pack(sin) is sin
    assert call.pack(made[1:]) is not None and isinstance(call.pack(made[1:]), torch.Tensor)
    saved = call.pack(made.t())
    assert isinstance(saved, block_offload.OffloadedTensor)
    assert offload.moved_down == made.numel() * made.element_size()
    back = block_offload.OffloadedCall.unpack(saved)
    assert torch.equal(back, made.t()) and back.stride() == made.t().stride()
    assert offload.late_uploads == 1  # nothing reached it first


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.integers(2, 4), st.integers(1, 9), st.integers(0, 3), st.data())
def test_an_offloaded_calls_device_tensors_go_back_after_the_wait_for_their_copies(
        in_flight, calls, after, data):
    """The throttle's bookkeeping ([Note: offloaded blocks]): as each offloaded call saves,
    the calls ``in_flight - 1`` and more before it give their device tensors back (the compute
    stream waited for their copies), so that at most ``in_flight`` calls hold device memory,
    the newest; the drain (a block after the last offloaded call, or the model's output) gives
    every call's back. The tensors are freed then, not later."""
    import weakref

    blocks = calls + after
    drained_at = data.draw(st.integers(calls, blocks))
    offload = block_offload.BlockOffload(torch.device("cpu"))
    offload.plan({b: b for b in range(blocks)},
                 recompute_plan.CopyQueue(tuple(range(calls)), in_flight, drained_at, 1))
    made, held = [], []
    for block in range(blocks):
        offload.forward_reaches(block)
        if block >= calls:
            assert (block < drained_at) == any(c._on_the_way for c in held)
            continue
        call = offload.start(block, (), {})
        offload.wait_for_previous(call)  # a call's first save, as ``pack`` on CUDA
        t = torch.empty(4)
        call._on_the_way.append(t)  # what ``pack`` holds while its copy runs on ``down``
        made.append(weakref.ref(t))
        held.append(call)
        del t
        holding = [i for i, c in enumerate(held) if c._on_the_way]
        assert holding == list(range(max(0, block - in_flight + 2), block + 1)), holding
        assert [i for i, r in enumerate(made) if r() is not None] == holding
    offload.finish_forward()
    assert not any(c._on_the_way for c in held) and all(r() is None for r in made)


@pytest.mark.parametrize("cores", [1, 2, 16, 64, 256])
def test_the_arenas_locking_takes_a_quarter_of_the_cores_at_most(monkeypatch, cores):
    """The locking runs beside the re-plan's compile ([Note: host arenas and the first
    offloaded step]): ``PIN_THREADS`` arenas at once, their touch threads together at most a
    quarter of this rank's share of the cores, one an arena at least."""
    asked = []

    class Recorded(block_offload.HostArena):
        def __init__(self, nbytes, device, streams=(), touch_threads=None):
            asked.append(touch_threads)
            super().__init__(nbytes, device, streams, touch_threads)

    monkeypatch.setattr(block_offload, "HostArena", Recorded)
    monkeypatch.setattr(block_offload, "host_core_share", lambda: cores)
    offload = block_offload.BlockOffload(torch.device("cpu"))
    offload.plan({b: b for b in range(6)}, recompute_plan.CopyQueue(tuple(range(6)), 2, 6, 1),
                 block_bytes=1 << 10)
    for position in range(6):
        offload._arenas[position].result()
    assert len(asked) == 6 and len(set(asked)) == 1
    assert asked[0] >= 1 and asked[0] * block_offload.PIN_THREADS <= max(
        block_offload.PIN_THREADS, cores // 4)


def arenas_ready_and_late(monkeypatch, init, steps, **train) -> tuple[Trained, Trained]:
    """``init`` trained with a copy at "keep" taking one forward, twice: with its arenas ready
    when planned (the plan waits for them: on CUDA a tiny model's first offloaded step can
    outrun their locking), and with them held back until the first offloaded forward has ended
    (then awaited, so that the next forward finds them all)."""
    from concurrent.futures import wait

    def plan_and_wait(self, *args, **kwargs):
        original_plan(self, *args, **kwargs)
        wait(list(self._arenas.values()))

    original_plan = block_offload.BlockOffload.plan
    monkeypatch.setattr(block_offload.BlockOffload, "plan", plan_and_wait)
    ready = _train(monkeypatch, init, 1, steps, **train)
    release = threading.Event()

    class SlowArena(block_offload.HostArena):
        def __init__(self, *args, **kwargs):
            release.wait()
            super().__init__(*args, **kwargs)

    def finish_forward(self):
        original_finish(self)
        if self.forwards and not release.is_set():
            release.set()
            wait(list(self._arenas.values()))

    original_finish = block_offload.BlockOffload.finish_forward
    monkeypatch.setattr(block_offload, "HostArena", SlowArena)
    monkeypatch.setattr(block_offload.BlockOffload, "finish_forward", finish_forward)
    return ready, _train(monkeypatch, init, 1, steps, **train)


def test_calls_whose_arena_is_still_locking_copy_through_pageable_memory(monkeypatch):
    """The forward never waits for an arena ([Note: host arenas and the first offloaded step]):
    while the arenas are still being locked, that forward's calls copy through pageable host
    memory, and from the next step on every call uses its arena; the run trains bit for bit as
    one whose arenas were ready."""
    steps = 4
    ready, late = arenas_ready_and_late(monkeypatch, decoder(7), steps)
    offload = late.frames.offload
    assert offload.unlocked_host_bytes == offload.moved_down // (steps - 1) > 0
    assert offload.unplanned_host_bytes == 0
    # The record times the re-plan and, from it, the arenas' locking (held back here for a
    # whole forward, so later than the ready run's).
    late_report, ready_report = offload.report(), ready.frames.offload.report()
    assert late_report["planned_in_s"] > 0 and ready_report["planned_in_s"] > 0
    assert set(block_offload.RANK_OWN) <= late_report.keys()
    assert late_report["arenas_locked_after_s"] > ready_report["arenas_locked_after_s"] >= 0
    assert late.losses == ready.losses
    assert all(torch.equal(late.params[k], ready.params[k]) for k in ready.params)


def test_hugging_face_layers_offloaded_train_as_the_same_layers_kept(monkeypatch):
    """Seven Hugging Face Qwen3 layers under their own checkpointing, every layer but the last
    offloaded: the losses and parameters of the same layers kept on the device, bit for bit,
    with no late upload (the layers' rotary tables, a keyword input, stay on the device)."""
    pytest.importorskip("transformers")
    from parity import tiny_qwen3

    init = tiny_qwen3(checkpointed=True, layers=7)
    data = token_batches(3)
    runs = []
    for to_host in (True, False):
        monkeypatch.setattr(block_replan.BlockReplanner, "_rank_host_link", _cpu_link(1))
        if not to_host:
            monkeypatch.setattr(block_offload.BlockOffload, "start",
                                lambda self, block, args, kwargs: None)
        torch._dynamo.reset()
        model = shard(copy.deepcopy(init))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cm = zbuf.compile(model, inner="aot_eager", structure="blocks", recompute="auto",
                          optimizer=opt)
        clamp_room(zbuf.compile.step_memory_of(cm), _reserve_only, _reserve_only)
        losses = train_adamw(cm, model, data, opt, loss_of=hf_loss)
        monkeypatch.undo()
        runs.append((losses, full_state_dict(model), block_frames_of(model).offload))
    (moved, moved_params, offload), (kept, kept_params, _) = runs
    assert offload.report()["blocks"] == list(range(6)) and offload.late_uploads == 0
    assert offload.moved_down == offload.moved_up > 0
    assert moved == kept
    assert all(torch.equal(moved_params[k], kept_params[k]) for k in kept_params)


def test_zbuf_report_shows_the_offloaded_blocks(monkeypatch):
    """``zbuf report``'s block schedule table names the offloaded blocks, the bytes they move
    each step, the copies' exposed time and their host arenas, from the frames' schedule of a
    run that offloaded (an older record without arenas shows "-"); a run that offloaded nothing
    has no such rows."""
    from rich.console import Console

    from zbuf.train.report import block_schedule_table

    run = _train(monkeypatch, decoder(7), 2, 3)

    def table(schedule):
        engine = {"engine": "zbuf", "status": "ok", "steps": [{"step": 0}],
                  "schedule": {"graphs": [], "blocks": schedule}}
        console = Console(width=200, record=True)
        console.print(block_schedule_table({"engines": [engine]}))
        return " ".join(console.export_text().split())

    offload = run.frames.offload
    text = table(run.frames.schedule())
    assert "of the kept, offloaded to host │ 3 │" in text, text
    per_step = offload.moved_down / offload.forwards / 1024
    assert f"to host and back per step │ {per_step:.2f} KiB │" in text, text
    assert "copies exposed per step │ 0.0 ms │" in text and "uploads started late │ 0 │" in text
    # The arenas, one per offloaded block (nothing to lock on the CPU stand-in).
    arenas = offload.report()["host_arena_bytes"] / 1024
    assert f"host memory page-locked │ {arenas:.2f} KiB in 0.0 s, " in text, text
    assert "copied before (the thread held 0.0 s) │" in text, text
    old = dict(run.frames.schedule())
    old["activation_offload"] = {k: v for k, v in old["activation_offload"].items()
                                 if k != "unlocked_copy_seconds"}
    assert "copied before │" in table(old)
    old["activation_offload"].pop("host_arena_bytes")
    assert "host memory page-locked │ - │" in table(old)
    quiet = dict(run.frames.schedule(), activation_offload={"blocks": []})
    assert "offloaded" not in table(quiet)


def test_the_host_has_no_block_clock():
    """On the host the block forward is not measured ([Note: the measured block forward]) and
    the plan falls back to the cost model."""
    clock = BlockClock(torch.device("cpu"))
    for _ in range(3):
        clock.block_started()
    clock.forward_finished()
    assert clock.block_seconds() is None
