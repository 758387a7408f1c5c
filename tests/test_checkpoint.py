"""Checkpoints (issue 7, "Must show"): bit-exact resume, resharding 2 -> 3 ranks, crash-safe saves.

One scenario, run as a sequence of launches over one checkpoint root (each launch is fresh
processes, as a restarted job would be):

1. 2 ranks train 10 steps uninterrupted, saving at step 5; they return their final shards and
   optimizer state.
2. 2 ranks load step 5, train to step 7 and die (SIGKILL, fault point) in the middle of saving
   step 7, after the data files were written and before the commit.
3. Fresh 2 ranks resume from the root: the latest *complete* checkpoint is step 5; they train to
   step 10: parameters and optimizer state are bit-identical to launch 1.
4. 2 ranks replace step 5 with a new save and rank 0 dies between the two renames of the commit.
5. 3 ranks load step 5 (read from where the interrupted replace left it) and train to step 10:
   parameters and AdamW state match an unsharded single-process reference to 1e-6.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import WorkerFailed, run_distributed

import zbuf.checkpoint as ckpt
from zbuf.models import ModelConfig, build_model, loss
from zbuf.train.data import Task, global_batch

# Uneven at 2 and 3 ranks (vocab*hidden = 2960, norm weights of 37 and 8), tied head.
CFG = ModelConfig(vocab_size=80, hidden_size=37, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, ffn_hidden_size=45, tie_embeddings=True, rope_theta=10_000.0,
                  max_seq_len=64)
SEQ, MICRO, SEED, LR = 12, 2, 3, 3e-3
SAVE_AT, STOP_AT = 5, 10


def _make(world: int):
    """The sharded model and its optimizer, identical on every rank and in every launch."""
    from zbuf.shard import shard

    torch.manual_seed(0)
    model = shard(build_model(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
    return model, opt


def _train(model, opt, rank: int, world: int, start: int, stop: int) -> None:
    # The global batch of a step is fixed; the rows split evenly over the ranks, so the
    # averaged reduce-scatter equals the gradient of the global mean loss.
    batch = MICRO * 6  # divisible by 2 and 3
    per_rank = batch // world
    for step in range(start, stop):
        b = global_batch(Task.STRIDE, SEED, step, batch, SEQ, CFG.vocab_size)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad(set_to_none=True)
        loss(model, b.tokens[rows], b.targets[rows]).backward()
        opt.step()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards and optimizer state, by name (copies)."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"s.{names[id(p)]}.{k}"] = v.detach().clone()
    return out


def _full_snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and AdamW moments, gathered: for cross-world comparisons."""
    from zbuf.shard import sharded_parameters

    out = {}
    seen = set()
    for fqn, _sub, _name, shard, spec in sharded_parameters(model):
        if spec.param_id in seen:
            continue
        seen.add(spec.param_id)
        for key, t in [("p", shard.detach())] + [(k, v) for k, v in opt.state[shard].items() if k != "step"]:
            buf = torch.empty(spec.shard_numel * spec.world_size, dtype=t.dtype)
            dist.all_gather_into_tensor(buf, t.contiguous())
            out[f"{key}.{fqn}"] = buf[: spec.numel].view(spec.shape).clone()
    return out


def _ship(obj) -> bytes:
    """Results as bytes: tensors returned through run_distributed's queue travel as shared-memory
    file descriptors that die with the worker before the parent can open them."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unship(results: list[bytes]) -> list:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


# ---------------------------------------------------------------------------------------------
# workers (module level: spawned processes import them by name)

RUN = {"id": "test-run"}  # the replace of step 5 is this run's own: save_checkpoint allows it


def _uninterrupted(rank, world, root):
    model, opt = _make(world)
    _train(model, opt, rank, world, 0, SAVE_AT)
    saved = ckpt.save_checkpoint(ckpt.checkpoint_path(root, SAVE_AT), model, opt, step=SAVE_AT,
                                 extra={"note": "first", "rng": torch.get_rng_state()}, run=RUN)
    at_save = _snapshot(model, opt)
    _train(model, opt, rank, world, SAVE_AT, STOP_AT)
    return _ship((str(saved), at_save, _snapshot(model, opt)))


def _crash_while_saving(rank, world, root):
    model, opt = _make(world)
    info = ckpt.load_checkpoint(root, model, opt)
    _train(model, opt, rank, world, info.step, 7)
    os.environ["ZBUF_FAULT"] = "checkpoint.after_data"
    ckpt.save_checkpoint(ckpt.checkpoint_path(root, 7), model, opt, step=7)
    return "survived"  # never reached: the fault point kills every rank


def _resume(rank, world, root):
    model, opt = _make(world)
    info = ckpt.load_checkpoint(root, model, opt)
    loaded = _snapshot(model, opt)
    _train(model, opt, rank, world, info.step, STOP_AT)
    return _ship((info, loaded, _snapshot(model, opt)))


def _crash_while_replacing(rank, world, root):
    model, opt = _make(world)
    ckpt.load_checkpoint(ckpt.checkpoint_path(root, SAVE_AT), model, opt)
    os.environ["ZBUF_FAULT"] = "checkpoint.between_renames@0"
    ckpt.save_checkpoint(ckpt.checkpoint_path(root, SAVE_AT), model, opt, step=SAVE_AT, run=RUN)
    return "survived"


def _resume_resharded(rank, world, root):
    model, opt = _make(world)
    info = ckpt.load_checkpoint(ckpt.checkpoint_path(root, SAVE_AT), model, opt)
    _train(model, opt, rank, world, info.step, STOP_AT)
    return _ship((info, _full_snapshot(model, opt)))


def _reference() -> dict[str, torch.Tensor]:
    """Unsharded, single process, the whole global batch per step."""
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
    _train(model, opt, 0, 1, 0, STOP_AT)
    out = {}
    for n, p in model.named_parameters():
        out[f"p.{n}"] = p.detach()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{n}"] = opt.state[p][k]
    return out


def _assert_bit_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different entries {a.keys() ^ b.keys()}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_resume_bit_exact_reshard_and_crash_safety(tmp_path):
    root = tmp_path / "ckpts"

    # 1. uninterrupted
    first = _unship(run_distributed(_uninterrupted, 2, str(root)))
    saved_path = Path(first[0][0])
    assert saved_path == ckpt.checkpoint_path(root, SAVE_AT) and ckpt.latest_checkpoint(root) == saved_path

    # 2. killed mid-save: no step 7 checkpoint, the leftover is only a hidden temp dir
    with pytest.raises(WorkerFailed, match="died"):
        run_distributed(_crash_while_saving, 2, str(root))
    assert (root / ".step_00000007.tmp").is_dir()
    assert not ckpt.checkpoint_path(root, 7).exists()
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [SAVE_AT]

    # 3. fresh processes resume from the latest complete checkpoint: bit-exact
    resumed = _unship(run_distributed(_resume, 2, str(root)))
    for rank in range(2):
        info, loaded, final = resumed[rank]
        assert info.step == SAVE_AT and info.world_size == 2 and info.has_optimizer
        assert info.extra["note"] == "first"
        assert info.extra["rng"].dtype == torch.uint8
        _assert_bit_identical(first[rank][1], loaded, f"rank {rank} state loaded at step {SAVE_AT}")
        _assert_bit_identical(first[rank][2], final, f"rank {rank} state at step {STOP_AT}")

    # 4. a replace of step 5 dies between its two renames: step 5 survives as .step_*.old
    with pytest.raises(WorkerFailed):
        run_distributed(_crash_while_replacing, 2, str(root))
    assert not saved_path.exists()
    survivor = ckpt.resolve_checkpoint(saved_path)
    assert survivor.name == f".{saved_path.name}.old"
    assert ckpt.read_checkpoint_info(root).step == SAVE_AT

    # 5. 2 -> 3 ranks, from the surviving copy, against the unsharded reference
    resharded = _unship(run_distributed(_resume_resharded, 3, str(root)))
    ref = _reference()
    for rank in range(3):
        info, full = resharded[rank]
        assert info.step == SAVE_AT and info.world_size == 2
        assert full.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(full[k], ref[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
