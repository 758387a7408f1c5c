"""Variable sequence lengths on 2 gloo ranks (issue 15, item 6): no hang, no schedule mismatch,
a bounded number of compiled graphs, a plan valid for the longest length, and a clear error (not a
hang) when ranks see different lengths in the same step. One launch does every case; aot_eager.

[Note: variable sequence lengths] in ``zbuf/compile/fingerprint.py`` says what happens and why.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from dist_utils import global_mean, run_distributed

LENGTHS = [256, 512, 384, 448]
RTOL = 1e-5


def _config():
    from zbuf.models import resolve_config

    return resolve_config("tiny").replace(num_layers=1)


def _batch(step: int, rank: int, length: int, vocab: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, vocab, (1, length + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _train(fn, model, batches, mark_max=None):
    """SGD steps; the mean loss over ranks per step."""
    world = torch.distributed.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens, targets in batches:
        if mark_max is not None:
            for t in (tokens, targets):
                torch._dynamo.mark_dynamic(t, 1, min=2, max=mark_max)
        loss = F.cross_entropy(fn(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(global_mean(loss, world, sharded=True))
    return losses


def _records(model):
    from zbuf.compile import schedule_report

    return [(r.kind, r.activation_peak_bytes, r.fingerprint) for r in schedule_report(model)]


def _varlen_case(rank, world, init, mark_max):
    """Every rank sees the same lengths; they change every step."""
    from zbuf.shard import shard

    torch._dynamo.reset()
    cfg = _config()
    batches = [_batch(s, rank, n, cfg.vocab_size) for s, n in enumerate(LENGTHS * 2)]
    eager = shard(copy.deepcopy(init))
    ref = _train(eager, eager, batches)
    model = shard(copy.deepcopy(init))
    cm = torch.compile(model, backend="zbuf", options={"inner": "aot_eager"}, fullgraph=True)
    losses = _train(cm, model, batches, mark_max)
    torch.testing.assert_close(losses, ref, rtol=RTOL, atol=0)
    return {"losses": losses, "records": _records(model)}


def _mismatch_case(rank, world, init):
    """Step 0: both ranks see 512 (a static graph compiles). Step 1: rank 0 sees 512 again (its
    compiled graph runs), rank 1 sees 384 (it compiles a dynamic one): the ranks must stop with
    ScheduleMismatchError, not pair one rank's check with the other's gathers. Also returns the
    static graph's records (the plan at 512)."""
    from zbuf.compile import ScheduleMismatchError
    from zbuf.shard import shard

    torch._dynamo.reset()
    cfg = _config()
    model = shard(copy.deepcopy(init))
    cm = torch.compile(model, backend="zbuf", options={"inner": "aot_eager"}, fullgraph=True)
    _train(cm, model, [_batch(0, rank, 512, cfg.vocab_size)])
    static_512 = _records(model)
    t0 = time.monotonic()
    try:
        _train(cm, model, [_batch(1, rank, 512 if rank == 0 else 384, cfg.vocab_size)])
    except ScheduleMismatchError as e:
        return static_512, str(e), time.monotonic() - t0
    return static_512, "different lengths on the ranks were not detected", time.monotonic() - t0


def _worker(rank, world):
    from zbuf.models import build_model

    torch.manual_seed(0)
    init = build_model(_config())
    return {"auto": _varlen_case(rank, world, init, None),
            "bounded": _varlen_case(rank, world, init, max(LENGTHS)),
            "mismatch": _mismatch_case(rank, world, init)}


def test_sequence_length_changes_every_step():
    results = run_distributed(_worker, 2, timeout=900)
    for key in ("auto", "bounded"):
        assert results[0][key] == results[1][key], key  # same losses and plans on both ranks
    auto, bounded = results[0]["auto"]["records"], results[0]["bounded"]["records"]
    # Automatic dynamic shapes: the first length compiles a static graph, the first change a
    # dynamic one that serves every later length (forward + backward record each).
    assert [k for k, _, _ in auto] == ["forward", "backward"] * 2, auto
    # Marked dynamic with a bound from the first step: one graph, planned for the longest
    # length: the activation peaks of the static graph compiled at 512, not of the first (256).
    assert [k for k, _, _ in bounded] == ["forward", "backward"], bounded
    static_512 = results[0]["mismatch"][0]
    assert [peak for _, peak, _ in bounded] == [peak for _, peak, _ in static_512], (bounded, static_512)
    for _, msg, seconds in (r["mismatch"] for r in results):
        assert "int64[1, 512] on rank" in msg and "mark_dynamic" in msg, msg
        assert seconds < 120, seconds
