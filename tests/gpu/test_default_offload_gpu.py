"""The default's offloaded blocks on CUDA ([Note: offloaded under the step's own peak] in
zbuf/compile/block_replan.py): planned from the measured step's real profile, they train as the
default that offloads nothing and never peak above it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parity import token_batches  # noqa: E402
from test_block_offload import _train, assert_copies_never_wait  # noqa: E402

from zbuf.compile import block_replan  # noqa: E402
from zbuf.compile.recompute_plan import queue_speed  # noqa: E402
from zbuf.host_link import LinkSpeed  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")]


def test_the_default_offloads_where_its_loss_peaks_and_never_peaks_higher(monkeypatch):
    """Twelve checkpointed blocks and an fp32 loss outside the model over a 32k vocabulary,
    whose logits peak the step after the forward: the measured step's profile leaves room for
    the reserve under that peak, so the default offloads blocks (a host link whose copy of a
    block at "keep" takes two blocks' forward), keeps its plan at the steady step, trains as the default
    without a host link (1e-5), and peaks, allocated and reserved, no higher than it."""
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=12, vocab_size=32768, hidden_size=1024,
                                         ffn_hidden_size=2816, num_heads=8, num_kv_heads=8,
                                         head_dim=128)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, True)
    batches = token_batches(5, vocab=32768, rows=8, length=513)
    moved = _train(monkeypatch, init, 2, 5, device="cuda", batches=batches,
                   recompute="checkpointed")
    plain = _train(monkeypatch, init, None, 5, device="cuda", batches=batches,
                   recompute="checkpointed")
    offload = moved.frames.offload
    # At the level the link carries best (a copy at "keep" takes two blocks' forward, at
    # "selective" one or two), the blocks whose copies the queue runs without a wait.
    blocks = offload.report()["blocks"]
    assert blocks and list(offload.queue.positions) == blocks, moved.memory.report()
    assert_copies_never_wait(offload.queue, offload.block_bytes, offload.link, 12)
    assert len({moved.frames.levels[b] for b in moved.frames.offload.offloaded}) == 1
    assert not moved.memory.steady.replanned
    assert offload.moved_down == offload.moved_up > 0 and offload.late_uploads == 0
    # Every host copy in its position's page-locked arena ([Note: host arenas and the first
    # offloaded step] in zbuf/compile/block_offload.py).
    report = offload.report()
    assert report["unplanned_host_bytes"] == 0 and report["lock_seconds"] > 0, report
    assert (0 < report["lock_touch_seconds"] + report["lock_register_seconds"]
            <= report["lock_seconds"]), report
    assert report["planned_in_s"] > 0 and report["arenas_locked_after_s"] > 0, report
    assert not plain.frames.offload.offloaded
    torch.testing.assert_close(moved.losses, plain.losses, rtol=1e-5, atol=0)
    assert len(moved.peaks) == len(plain.peaks) == 5
    for ours, theirs in ((moved.peaks, plain.peaks), (moved.reserved, plain.reserved)):
        for with_host, without, peak in zip(moved.rise(ours), plain.rise(theirs), theirs[2:]):
            assert with_host <= without + peak // block_replan.SETTLE_TOLERANCE, (ours, theirs)


def test_a_probe_that_found_no_room_is_not_kept(monkeypatch):
    """The host link's probe, taken at the measured step's output for the arenas locked ahead
    ([Note: arenas locked ahead] in zbuf/compile/block_offload.py), finds no room: nothing is
    locked ahead, and the re-plan after the step probes again instead of planning with no link
    ([Note: the measured host link] in zbuf/host_link.py), once; the later plans keep its
    speed."""
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=6, hidden_size=512, ffn_hidden_size=1408)
    torch.manual_seed(0)
    init = build_model(cfg)
    apply_activation_checkpointing(init, True)
    probes = []
    measure = block_replan.measure_host_link

    def first_finds_no_room(device):
        probes.append(device)
        return LinkSpeed(0.0, 0.0) if len(probes) == 1 else measure(device)

    monkeypatch.setattr(block_replan, "measure_host_link", first_finds_no_room)
    run = _train(monkeypatch, init, None, 4, device="cuda", recompute="checkpointed",
                 real_link=True)
    assert len(probes) == 2, probes
    assert run.frames.offload.report()["arenas_locked_ahead"] == 0
    # The plan's speed is the copy queue's of the two directions the probe read.
    probe = run.frames.offload.report()["host_link_probe"]
    assert probe["down"] > 0 and probe["up"] > 0
    assert run.memory.replanner.link_bytes_per_second == queue_speed(probe["down"], probe["up"])

