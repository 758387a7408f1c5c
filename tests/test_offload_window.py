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


def _fits(profile, window, slot, ceiling, step_slots=SLOTS):
    """Every segment with the slots the window holds through it, and its optimizer step, fit
    under ``ceiling`` (raw segments, counted slot by slot: the planner's promise restated)."""
    def fit(peak, held):
        return held == 0 or peak + held * slot <= ceiling

    backward = all(fit(p, sum(u <= j for u in window.uploads))
                   for j, p in enumerate(profile.backward))
    forward = all(fit(p, sum(r > k for r in window.releases))
                  for k, p in enumerate(profile.forward))
    return (backward and forward
            and profile.optimizer + max(0, window.slots - step_slots) * slot <= ceiling)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(forward=peaks, backward=peaks, optimizer=st.integers(0, 100),
       buckets=st.integers(0, 12), slot=st.integers(1, 20), usable=st.integers(0, 150),
       frag=st.integers(0, PPM), busy=st.integers(-1, 14))
def test_the_window_holds_each_slot_only_where_the_profiled_step_had_room(
        forward, backward, optimizer, buckets, slot, usable, frag, busy):
    profile = StepProfile(0, tuple(forward), tuple(backward), optimizer)
    ceiling = _ceiling(profile, usable, frag)
    window = plan_window(profile, buckets, slot, usable, frag, SLOTS, link_busy_until=busy)
    first = min(busy + 1, len(backward) - 1)  # the offloaded blocks' uploads have the link
    last = len(forward) - 1

    def window_of(slots):  # every bucket at the end of backward, every slot released at once
        return OffloadWindow((len(backward) - 1,) * slots, (0,) * slots)

    if window is None:
        # Not even the step's own slots (or every bucket, if fewer) fit at the end of backward.
        assert buckets == 0 or not _fits(profile, window_of(min(SLOTS, buckets)), slot, ceiling)
        return
    assert min(SLOTS, buckets) <= window.slots <= buckets
    assert list(window.uploads) == sorted(window.uploads)
    assert list(window.releases) == sorted(window.releases)
    assert all(first <= u < len(backward) for u in window.uploads)
    assert all(0 <= r <= last for r in window.releases)
    assert _fits(profile, window, slot, ceiling)  # never above the step's own peak
    # The most slots, each bucket uploaded as early and each slot released as late as fits.
    assert window.slots == buckets or not _fits(profile, window_of(window.slots + 1), slot,
                                                ceiling)
    for i, u in enumerate(window.uploads):
        if u > first:
            earlier = window.uploads[:i] + (u - 1,) * (window.slots - i)
            assert not _fits(profile, window._replace(uploads=tuple(
                min(a, b) for a, b in zip(window.uploads, earlier))), slot, ceiling)
    for t, r in enumerate(window.releases):
        if r < last:
            later = tuple(max(x, r + 1) if k <= t else x
                          for k, x in enumerate(window.releases))
            assert not _fits(profile, window._replace(releases=later), slot, ceiling)


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
    # 20 slots fit at the end of backward (25 - 15 GiB), beside the optimizer step's 16 GiB
    # with its own two; 8 of them from point 1 on (25 - 21), 14 from point 2 (25 - 18). In the
    # next forward 16 may stay past its start (25 - 17), 10 past point 1 (25 - 20).
    assert window.slots == 20
    assert window.uploads == (1,) * 8 + (2,) * 6 + (3,) * 6
    assert window.releases == (1,) * 4 + (2,) * 6 + (3,) * 10
    # On a card with less room than the step's peak leaves, the card decides: 20 GiB charged
    # 10 % fragmentation (18.18 GiB) leaves 6 slots at the end of backward, 6 past the forward's
    # start, 2 past its first block.
    small = plan_window(profile, 28, gib // 2, 20 * gib, PPM // 10, SLOTS)
    assert small == OffloadWindow((3,) * 6, (1,) * 4 + (2,) * 2)


def test_the_window_uploads_after_the_offloaded_blocks_on_the_shared_link():
    """The offloaded blocks' uploads, which backward waits for, have the upward link to
    themselves: the buckets that fitted from point 1 wait for the point after the last such
    upload, and the window keeps every slot (the room only grows later in backward)."""
    gib = 1 << 30
    profile = StepProfile(0, forward=(15 * gib, 17 * gib, 20 * gib, 25 * gib),
                          backward=(25 * gib, 21 * gib, 18 * gib, 15 * gib),
                          optimizer=16 * gib)
    alone = plan_window(profile, 28, gib // 2, 70 * gib, 0, SLOTS)
    shared = plan_window(profile, 28, gib // 2, 70 * gib, 0, SLOTS, link_busy_until=1)
    assert alone.uploads == (1,) * 8 + (2,) * 6 + (3,) * 6
    assert shared == alone._replace(uploads=(2,) * 14 + (3,) * 6)
    # Busy to the end of backward: every bucket at its last point, as room allows anyway.
    late = plan_window(profile, 28, gib // 2, 70 * gib, 0, SLOTS, link_busy_until=9)
    assert late.uploads == (3,) * 20 and late.releases == alone.releases


# -- the executor on CPU -----------------------------------------------------------------------

def _live(off):
    return sum(s is not None for s in off.slots)


def _windowed_train(kind, steps, window, bucket=100, accumulate=1, points=(4, 3)):
    """Steps driven as ``zbuf.compile``'s progress points drive them: forward points, backward
    points (``accumulate`` backwards a step), then the optimizer step. ``bucket=100``: five
    buckets of ``SHAPES``' AdamW state, four of SGD's."""
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
                log.append(("forward", k, _live(off)))
            for j in range(backward):
                off.at(Point("backward", j))
                log.append(("backward", j, _live(off)))
        _grads(params, step)
        opt.step()
        opt.zero_grad()
        log.append(("after step", _live(off)))
    return params, opt, off, log


WINDOWS = [OffloadWindow((1, 1, 1), (2, 2, 2)), OffloadWindow((0, 1, 2, 2), (0, 1, 1, 3)),
           OffloadWindow((0,) * 4, (3,) * 4), OffloadWindow((2, 2), (0, 0))]


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd"])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_windowed_step_is_bit_exact_and_moves_each_byte_once_each_way(kind, window):
    ref, ref_opt, _ = _train(kind, 4)
    params, opt, off, log = _windowed_train(kind, 4, window)
    n = len(off.buckets)
    assert n == (4 if kind == "sgd" else 5)
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt, ref, params)
    streamed = sum(b.used for b in off.buckets)
    assert [r.uploaded_bytes for r in off.records] == [0] + [streamed] * 3
    assert [r.downloaded_bytes for r in off.records] == [streamed] * 4
    # From step 1 on, bucket i is uploaded at backward point uploads[i], each slot stays until
    # its release point in the next forward, and the step's ring has the window's slots.
    step2 = log[log.index(("step", 2)):log.index(("step", 3))]
    for j in range(3):
        mark = step2.index(("backward", j, sum(u <= j for u in window.uploads)))
        before = [e[1] for e in step2[:mark] if e[0] == "upload"]
        assert before == [i for i, u in enumerate(window.uploads) if u <= j]
    stepped = step2.index(("step_bucket", 0))
    assert sorted(e[1] for e in step2[stepped:] if e[0] == "upload") == list(
        range(window.slots, n))
    assert ("after step", window.slots) in step2
    for k in range(4):
        assert ("forward", k, sum(r > k for r in window.releases)) in step2
    assert off.report()["device_slot_bytes"] == window.slots * off.slot_bytes
    assert off.report()["window"] == window._asdict()


def test_gradient_accumulation_turns_the_window_off_without_changing_a_number():
    ref, ref_opt, _ = _train("adamw", 4)
    window = OffloadWindow((1, 1, 1), (2, 2, 2))
    params, opt, off, log = _windowed_train("adamw", 4, window, accumulate=2)
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
        return OffloadWindow((0, 1, 1, 2, 2), (1, 1, 2, 2, 2))

    kept = _plain_run(False, steps=7)
    with mock.patch.object(zbuf.offload_choice, "plan_window", sized):
        moved = _plain_run(True, steps=7)
    assert moved[0] == kept[0]
    for a, b in zip(kept[1], moved[1]):
        assert torch.equal(a, b)
    (profile,) = profiles
    rec = moved[2]
    assert rec["window"] == {"uploads": (0, 1, 1, 2, 2), "releases": (1, 1, 2, 2, 2)}
    assert rec["window_sized_from"]["step"] == profile.step == 3  # the first settled step
    assert len(profile.forward) == 3  # the forward's start and two block frames
    params = sum(p.numel() * 4 for p in moved[1])
    assert len(profile.backward) == 1 + params // (16 << 10)  # the start and each mark
    moved_each_way = rec["bytes_moved_per_step"] // 2
    assert [s["uploaded_bytes"] for s in rec["steps"]] == [0] + [moved_each_way] * 6
    assert [s["downloaded_bytes"] for s in rec["steps"]] == [moved_each_way] * 7


def test_the_progress_remembers_where_backward_last_began_an_upload():
    """[Note: progress points]: the last backward point at which an offloaded block's upload
    began, read when the window is sized (the next forward has not reached a backward yet);
    forward uploads (none are planned) and earlier steps' do not count."""
    from zbuf.memory.progress import StepProgress

    model = torch.nn.Linear(4, 4, bias=False)  # 64 bytes of gradient
    import zbuf.memory.progress as progress_module

    with mock.patch.object(progress_module, "MARK_BYTES", 16):
        progress = StepProgress(model)
        progress.watch_gradients()
        progress.forward_started()
        progress.upload_started()
        assert progress.link_busy_until == -1
        progress.backward_started()
        progress.upload_started()
        assert progress.link_busy_until == 0
        model(torch.ones(1, 4)).sum().backward()  # four marks
        progress.upload_started()
        progress.forward_started()
        assert progress.link_busy_until == 4
        progress.backward_started()
        assert progress.link_busy_until == -1
        progress.detach()
