"""The step's window ([Note: the step's window] in zbuf/offload_window.py): the planner holds slots
only where the profiled step had room for them, and the most it can; the executor uploads the
window's buckets at its backward point, steps every bucket bit for bit as the state on the
device, moves each byte once each way per step, and lets the slots go at the next forward's
point; gradient accumulation turns it off without changing a number; the profile's segments
are the step's progress points ([Note: progress points] in zbuf/memory/progress.py)."""

import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zbuf.memory.ledger import PPM
from zbuf.memory.phases import StepProfile
from zbuf.memory.progress import Point
from zbuf.offload_window import OffloadWindow, plan_window
from zbuf.optimizer_step_offload import SLOTS, StepOffload

from test_step_offload import _grads, _optimizer, _params, _plain_run, _state_equal, _train

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))

# -- the planner (pure) ------------------------------------------------------------------------

peaks = st.lists(st.integers(0, 100), min_size=1, max_size=12)


def _ceiling(profile, usable, frag):
    return min(profile.peak, usable * PPM // (PPM + frag))


def _holds(profile, window, slot, ceiling):
    """Every segment the window's slots are held through, and its optimizer step, fit."""
    extra = window.slots * slot
    held = list(profile.backward[window.upload_at:]) + list(profile.forward[:window.release_at])
    return (all(p + extra <= ceiling for p in held)
            and profile.optimizer + (window.slots - SLOTS) * slot <= ceiling)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(forward=peaks, backward=peaks, optimizer=st.integers(0, 100),
       buckets=st.integers(0, 12), slot=st.integers(1, 20), usable=st.integers(0, 150),
       frag=st.integers(0, PPM))
def test_the_window_holds_its_slots_only_where_the_profiled_step_had_room(
        forward, backward, optimizer, buckets, slot, usable, frag):
    profile = StepProfile(0, tuple(forward), tuple(backward), optimizer)
    ceiling = _ceiling(profile, usable, frag)
    window = plan_window(profile, buckets, slot, usable, frag, SLOTS)
    candidates = [OffloadWindow(s, j, 0) for s in range(SLOTS + 1, buckets + 1)
                  for j in range(len(backward))]
    fitting = [w for w in candidates if _holds(profile, w, slot, ceiling)]
    if window is None:
        assert not fitting  # nothing beyond the step's own slots fits anywhere
        return
    assert SLOTS < window.slots <= buckets
    assert 0 <= window.upload_at < len(backward) and 0 <= window.release_at < len(forward)
    assert _holds(profile, window, slot, ceiling)  # never above the step's own peak
    # The most slots that fit anywhere, uploading as early and releasing as late as they allow.
    assert window.slots == max(w.slots for w in fitting)
    assert window.upload_at == min(w.upload_at for w in fitting if w.slots == window.slots)
    later = window._replace(release_at=window.release_at + 1)
    assert later.release_at >= len(forward) or not _holds(profile, later, slot, ceiling)


def test_the_window_fits_under_the_peak_the_offload_saved():
    """qwen3-14b's shape, in GiB: the forward's and backward's peaks are the activations', the
    tail of backward and the head of forward hold the shards and the gradients. The window
    fills the room under the step's own peak there, not the card."""
    gib = 1 << 30
    profile = StepProfile(0, forward=(15 * gib, 17 * gib, 20 * gib, 25 * gib),
                          backward=(25 * gib, 21 * gib, 18 * gib, 15 * gib),
                          optimizer=16 * gib)
    window = plan_window(profile, buckets=28, slot_bytes=gib // 2, usable_bytes=70 * gib,
                         fragmentation_ppm=0, step_slots=SLOTS)
    # 20 slots fit beside the optimizer step's 16 GiB under 25, and beside backward's last
    # segment and forward's first.
    assert window == OffloadWindow(slots=20, upload_at=3, release_at=1)
    # On a card with less room than the step's peak leaves, the card decides: 20 GiB charged
    # 10 % fragmentation.
    assert plan_window(profile, 28, gib // 2, 20 * gib, PPM // 10, SLOTS) == OffloadWindow(
        slots=6, upload_at=3, release_at=1)


# -- the executor on CPU -----------------------------------------------------------------------

def _windowed_train(kind, steps, window, bucket=300, accumulate=1, points=(4, 3)):
    """Steps driven as ``zbuf.compile``'s progress points drive them: forward points, backward
    points (``accumulate`` backwards a step), then the optimizer step."""
    params = _params(0)
    opt = _optimizer(kind, params)
    off = StepOffload(opt, torch.device("cpu"), bucket_bytes=bucket)
    log = []
    for kind_ in ("upload", "step_bucket", "download"):
        real = getattr(off, f"_{kind_}")
        setattr(off, f"_{kind_}", lambda i, s, real=real, k=kind_: (log.append((k, i)),
                                                                      real(i, s))[1])
    forward, backward = points
    for step in range(steps):
        log.append(("step", step))
        if step == 1:
            off.window = window  # the plan sizes it after a step, once the state exists
        for _ in range(accumulate):
            for k in range(forward):
                off.at(Point("forward", k))
                log.append(("forward", k, len(off.slots)))
            for j in range(backward):
                off.at(Point("backward", j))
                log.append(("backward", j, len(off.slots)))
        _grads(params, step)
        opt.step()
        opt.zero_grad()
        log.append(("after step", len(off.slots)))
    return params, opt, off, log


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd"])
@pytest.mark.parametrize("window", [OffloadWindow(3, 1, 2), OffloadWindow(4, 0, 0),
                                    OffloadWindow(6, 2, 3)])
def test_the_windowed_step_is_bit_exact_and_moves_each_byte_once_each_way(kind, window):
    ref, ref_opt, _ = _train(kind, 4)
    params, opt, off, log = _windowed_train(kind, 4, window)
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt, ref, params)
    streamed = sum(b.used for b in off.buckets)
    assert [r.uploaded_bytes for r in off.records] == [0] + [streamed] * 3
    assert [r.downloaded_bytes for r in off.records] == [streamed] * 4
    slots = min(window.slots, len(off.buckets))
    # From step 1 on the window's buckets are uploaded at its backward point, and its slots
    # stay until the next forward's release point.
    step2 = log[log.index(("step", 2)):log.index(("step", 3))]
    at_upload = step2.index(("backward", window.upload_at, slots))
    assert [e for e in step2[:at_upload] if e[0] == "upload"] == [
        ("upload", i) for i in range(slots)]
    assert not [e for e in step2[at_upload:] if e[0] == "upload" and e[1] < slots]
    assert ("after step", slots) in step2
    for k in range(4):
        assert ("forward", k, slots if k < window.release_at else 0) in step2
    assert off.report()["device_slot_bytes"] == slots * off.slot_bytes


def test_gradient_accumulation_turns_the_window_off_without_changing_a_number():
    ref, ref_opt, _ = _train("adamw", 4)
    params, opt, off, log = _windowed_train("adamw", 4, OffloadWindow(3, 1, 2), accumulate=2)
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt, ref, params)
    assert off.window is None and "gradient accumulation" in off.window_off
    assert off.report()["window_off"] == off.window_off
    streamed = sum(b.used for b in off.buckets)
    # Step 1 uploaded the window's buckets in its first backward and again in its step.
    ahead = sum(b.used for b in off.buckets[:3])
    assert [r.uploaded_bytes for r in off.records] == [0, streamed + ahead, streamed, streamed]


# -- through zbuf.compile ----------------------------------------------------------------------

@pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")
def test_the_plain_loop_profiles_a_settled_step_and_trains_bit_exact_in_its_window(monkeypatch):
    """``zbuf.compile(model, optimizer=opt, offload_optimizer=True)``: once the plan settled, one
    step is profiled at its progress points (one segment per point: the forward's start and each
    block frame; the backward's start and each gradient mark), the window is sized from it and
    the steps after it run in it, bit for bit as the state on the device. The CPU stand-in sees
    no activations (its backward ends at its peak), so the window is given here."""
    import zbuf.memory.progress
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)
    monkeypatch.setattr(zbuf.memory.progress, "MARK_BYTES", 16 << 10)
    profiles = []

    def sized(profile, buckets, *args):
        profiles.append(profile)
        return OffloadWindow(min(buckets, 5), 1, 2)

    kept = _plain_run(False, steps=7)
    with mock.patch.object(zbuf.offload_choice, "plan_window", sized):
        moved = _plain_run(True, steps=7)
    assert moved[0] == kept[0]
    for a, b in zip(kept[1], moved[1]):
        assert torch.equal(a, b)
    (profile,) = profiles
    rec = moved[2]
    assert rec["window"] == {"slots": 5, "upload_at": 1, "release_at": 2}
    assert rec["window_sized_from"]["step"] == profile.step == 3  # the first settled step
    assert len(profile.forward) == 3  # the forward's start and two block frames
    params = sum(p.numel() * 4 for p in moved[1])
    assert len(profile.backward) == 1 + params // (16 << 10)  # the start and each mark
    moved_each_way = rec["bytes_moved_per_step"] // 2
    assert [s["uploaded_bytes"] for s in rec["steps"]] == [0] + [moved_each_way] * 6
    assert [s["downloaded_bytes"] for s in rec["steps"]] == [moved_each_way] * 7
