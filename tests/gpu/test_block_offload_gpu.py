"""Offloaded blocks on CUDA ([Note: offloaded blocks] in zbuf/compile/block_offload.py): the
kept activations of every offloaded block call copied to pinned host memory on the ``down``
stream and back on the ``up`` stream; the same floats as the same plan with them kept on the
device, and a lower peak, allocated and reserved."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parity import token_batches  # noqa: E402
from test_block_offload import _train, arenas_ready_and_late  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")]


def _checkpointed_decoder(layers: int, rows: int = 4):
    """A decoder whose activations outweigh its weights, each block checkpointed, and four
    batches of ``rows`` rows for it."""
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=layers, vocab_size=97, hidden_size=512,
                                         ffn_hidden_size=1408, head_dim=64)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, True)
    return init, token_batches(4, vocab=97, rows=rows, length=257)


@contextlib.contextmanager
def _deterministic():
    """Deterministic kernels, so that two runs of the same floats agree bit for bit."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_offloaded_blocks_train_bit_for_bit_on_cuda_below_the_kept_peak(monkeypatch):
    """Eight blocks of a decoder whose activations outweigh its weights, every block but the
    last offloaded (a copy at "keep" takes one block's forward; the last copy drains at the
    model's output: [Note: the copy queue]): the losses and parameters of the same plan with
    those blocks kept on the device, bit for bit (deterministic kernels), every upload started
    before its backward, and each step's peak, allocated and reserved, lower by more than three
    blocks' activations. Kept, the seven blocks are live together at the start of backward;
    offloaded, at most two are on their way down beside the one computing, and one on its way up
    beside the one in backward: four fewer, one of them left to the allocator's rounding. Sixteen
    rows, so that the activations and not the optimizer's step (four times the 78 MiB of fp32
    parameters) make each step's peak."""
    init, batches = _checkpointed_decoder(8, rows=16)
    with _deterministic():
        moved = _train(monkeypatch, init, 1, 4, device="cuda", batches=batches)
        kept = _train(monkeypatch, init, 1, 4, device="cuda", batches=batches, to_host=False)
    offload = moved.frames.offload
    assert offload.report()["blocks"] == list(range(7))
    assert offload.report()["drained_at_output"]
    assert offload.moved_down == offload.moved_up > 0 and offload.late_uploads == 0
    report = offload.report()
    assert offload.forwards == 3 and report["exposed_ms_per_step"] >= 0.0
    assert sum(report["exposed_ms_per_step_by_wait"].values()) == pytest.approx(
        report["exposed_ms_per_step"])
    # Every offloaded call's copies timed on the down stream: the bytes the device moved in the
    # time it took, no faster than a copy engine runs (under 1 TB/s) and not stalled.
    assert report["measured_copy_ms"] > 0
    assert 1e8 < report["measured_copy_bytes_per_second"] < 1e12
    assert moved.frames.schedule()["measured_block_forward_ms"] > 0
    assert kept.frames.offload.moved_down == 0
    assert moved.losses == kept.losses
    assert all(torch.equal(moved.params[k], kept.params[k]) for k in kept.params)
    assert offload.report()["in_flight"] == 2 and offload.report()["upload_ahead"] == 1
    per_block = offload.moved_down // 3 // 7  # steps 1-3 moved every offloaded call's bytes
    assert len(moved.peaks) == len(kept.peaks) == 4
    for with_host, on_device in zip(moved.rise(moved.peaks), kept.rise(kept.peaks)):
        assert with_host < on_device - 3 * per_block, (moved.peaks, kept.peaks, per_block)
    # torch's cache too: the uploads come out of the blocks backward frees, not out of
    # segments of their own (torch's caching allocator keeps each stream's blocks apart).
    for with_host, on_device in zip(moved.rise(moved.reserved), kept.rise(kept.reserved)):
        assert with_host < on_device - 3 * per_block, (moved.reserved, kept.reserved, per_block)


SLEEP_CYCLES = 2_000_000_000
"""About a second of an H100's or H200's clock: longer than the tiny decoder's forward takes the
Python thread to queue."""


def test_offloaded_memory_goes_back_in_the_compute_streams_order(monkeypatch):
    """The Python thread far ahead of the device (each step queued behind a kernel that sleeps
    on the compute stream): the offloaded calls' device memory goes back to torch's cache in the
    compute stream's order, right after it waited for their copies ([Note: offloaded blocks]),
    so each step peaks where it does with the device keeping up. Returned through
    ``record_stream`` instead, none of it could be reused before the allocator saw the copies
    run, and the later blocks took new memory (at qwen3-14b, the card's limit: a retry). The
    same floats, bit for bit."""
    from parity import decoder_loss

    init, batches = _checkpointed_decoder(8)
    queued_ahead = []

    def behind_a_sleeping_device(step_fn, tokens):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.current_stream().record_event()
        loss = decoder_loss(step_fn, tokens)
        queued_ahead.append(not slept.query())
        return loss

    with _deterministic():
        keeping_up = _train(monkeypatch, init, 1, 4, device="cuda", batches=batches)
        behind = _train(monkeypatch, init, 1, 4, device="cuda", batches=batches,
                        loss_of=behind_a_sleeping_device)
    offload = behind.frames.offload
    assert offload.report()["blocks"] == keeping_up.frames.offload.report()["blocks"]
    # The last forward was queued whole before the device woke (a re-plan's reading of the
    # block clock may wait for the device in an earlier one).
    assert queued_ahead[-1], queued_ahead
    per_block = offload.moved_down // 3 // len(offload.report()["blocks"])
    assert len(behind.peaks) == len(keeping_up.peaks) == 4
    for lagging, steady in zip(behind.rise(behind.peaks), keeping_up.rise(keeping_up.peaks)):
        assert lagging <= steady + per_block // 2, (behind.peaks, keeping_up.peaks, per_block)
    assert behind.losses == keeping_up.losses


def test_calls_copied_through_pageable_memory_train_bit_for_bit_on_cuda(monkeypatch):
    """The first offloaded forward's arenas held back ([Note: host arenas and the first
    offloaded step] in zbuf/compile/block_offload.py): its calls copy to pageable host memory and
    back (copies that hold the host thread), the later steps through the arenas; the losses and
    parameters of the run whose arenas were ready, bit for bit."""
    init, batches = _checkpointed_decoder(6)
    with _deterministic():
        ready, late = arenas_ready_and_late(monkeypatch, init, 4, device="cuda", batches=batches)
    offload = late.frames.offload
    assert offload.unlocked_host_bytes == offload.moved_down // 3 > 0
    assert offload.unplanned_host_bytes == 0 and offload.late_uploads == 0
    # The host thread waited for those copies, and only for those.
    assert offload.unlocked_copy_seconds > 0 == ready.frames.offload.unlocked_copy_seconds
    assert late.losses == ready.losses
    assert all(torch.equal(late.params[k], ready.params[k]) for k in ready.params)


@pytest.mark.parametrize("small_host,level", [(False, 2), (True, 1)])
def test_blocks_under_the_parents_checkpoint_offloaded_bit_for_bit_on_cuda(monkeypatch,
                                                                           small_host, level):
    """The parent's checkpoint around each block call ([Note: a block under the caller's
    checkpoint] in zbuf/compile/block_frames.py), the default's plan on CUDA, at "keep" and,
    where the host holds less than one block at "keep", at the "selective" frame zbuf tags (a
    copy taking four blocks' forward left "keep" the plan's choice here): the offloaded
    blocks' frames save under zbuf's hooks and copy on the ``down`` and ``up`` streams, every
    upload started before its backward; the losses and parameters of the same blocks kept on
    the device, bit for bit, and of the unsharded reference (1e-5)."""
    import copy

    from parity import train_adamw
    from test_block_offload import _room_under_the_peak
    from test_user_checkpointing import VOCAB, Decoder

    torch.manual_seed(0)
    init = Decoder("parent", layers=6)
    batches = token_batches(4, vocab=VOCAB, rows=4, length=65)
    train = dict(device="cuda", batches=batches, recompute="checkpointed")
    with _deterministic():
        moved = _train(monkeypatch, init, 1, 4, ceiling=_room_under_the_peak(),
                       host_below_keep=small_host, **train)
        kept = _train(monkeypatch, init, 1, 4, ceiling=_room_under_the_peak(), to_host=False,
                      host_below_keep=small_host, **train)
    frames, offload = moved.frames, moved.frames.offload
    assert frames.callers_checkpoint and offload.offloaded and frames.called
    assert {frames.levels.get(b, 0) for b in offload.offloaded} == {level}
    if level == 2:  # a copy takes one block's forward: every block but the last
        assert offload.report()["blocks"] == [0, 1, 2, 3, 4]
    assert offload.moved_down == offload.moved_up > 0 and offload.late_uploads == 0
    assert moved.losses == kept.losses
    assert all(torch.equal(moved.params[k], kept.params[k]) for k in kept.params)
    ref = copy.deepcopy(init).cuda()
    ref_losses = train_adamw(ref, ref, [b.cuda() for b in batches],
                             torch.optim.AdamW(ref.parameters(), lr=1e-3))
    torch.testing.assert_close(moved.losses, ref_losses, rtol=1e-5, atol=0)
