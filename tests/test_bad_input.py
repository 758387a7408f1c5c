"""The bad-input catalogue (issue 7): every misuse gets an error that names the problem and the fix.

Runs in this process on a one-rank gloo group (the checks are the same code at any world size;
the multi-rank agreement of checkpoint errors is covered in test_checkpoint.py). The op and
``shard()`` checks live in ``zbuf/ops.py`` and ``zbuf/shard.py``; the checkpoint checks in
``zbuf/checkpoint/``; budgets follow the pool's and the compile pass's documented contracts.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zbuf.checkpoint as ckpt
import zbuf.ops  # noqa: F401 - registers torch.ops.zbuf.*
from zbuf.checkpoint.files import MANIFEST_NAME


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


def _group_name() -> str:
    return dist.distributed_c10d._get_default_group().group_name


def _net(hidden: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _sharded(hidden: int = 5):
    import zbuf.shard

    model = zbuf.shard(_net(hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"s.{names[id(p)]}.{k}": v.detach().clone() for k, v in st.items()})
    return out


def _unchanged(before, model, opt) -> bool:
    after = _state(model, opt)
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------
# the ops


def _gather(shard, shape, param_dtype=None):
    return torch.ops.zbuf.all_gather(shard, 90_001, list(shape), _group_name(), param_dtype, None)


def test_gather_shard_too_small_for_shape():
    with pytest.raises(ValueError, match="does not belong to this shard"):
        _gather(torch.randn(4), (6,))


def test_reduce_scatter_gradient_too_large():
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.zbuf.reduce_scatter(torch.randn(9), 90_002, 6, _group_name(), None, torch.float32)


def test_gather_shard_too_large_for_shape():
    # ceil(6 / 1) = 6 elements expected; 9 means the shard belongs to another parameter
    with pytest.raises(ValueError, match="shard"):
        _gather(torch.randn(9), (6,))


def test_gather_non_contiguous_shard():
    with pytest.raises(ValueError, match="contiguous"):
        _gather(torch.randn(12)[::2], (6,))


def test_gather_two_dimensional_shard():
    with pytest.raises(ValueError, match="1-D"):
        _gather(torch.randn(2, 3), (6,))


def test_gather_integer_param_dtype():
    with pytest.raises((TypeError, ValueError), match="param_dtype"):
        _gather(torch.randn(6), (6,), param_dtype=torch.int64)


def test_reduce_scatter_integer_reduce_dtype():
    with pytest.raises((TypeError, ValueError), match="reduce_dtype"):
        torch.ops.zbuf.reduce_scatter(torch.randn(6), 90_003, 6, _group_name(), torch.int32, torch.float32)


def test_shard_rejects_integer_param_dtype():
    import zbuf.shard

    with pytest.raises(zbuf.ShardingError, match="param_dtype must be a floating-point"):
        zbuf.shard(_net(), param_dtype=torch.int32)


def test_release_of_foreign_tensor():
    with pytest.raises(ValueError, match="not a live buffer of the pool it names"):
        torch.ops.zbuf.release(torch.randn(3))


# ---------------------------------------------------------------------------------------------
# budgets below the largest gather


def test_pool_budget_below_request_allocates_outside():
    # Documented pool contract: a request the budget cannot hold is served outside the pool (a
    # miss), never refused; the budget itself is clamped to the hard cap.
    from zbuf.pool import GatherBufferPool

    pool = GatherBufferPool("cpu", budget_bytes=1024)
    t = pool.acquire((4096,), torch.float32)
    s = pool.stats()
    assert (s.outside_allocations, s.charged_bytes, s.checked_out) == (1, 0, 1)
    pool.release(t)
    assert pool.stats().checked_out == 0
    assert pool.set_budget(1 << 62) == pool.stats().hard_cap_bytes


def test_pool_negative_budget():
    from zbuf.errors import PoolError
    from zbuf.pool import GatherBufferPool

    with pytest.raises(PoolError, match="budget_bytes must be >= 0"):
        GatherBufferPool("cpu", budget_bytes=-1)


def test_compile_budget_below_largest_gather_is_raised_and_reported():
    # Documented compile contract (CompileOptions.budget_bytes): raised to the feasible floor,
    # which is at least the largest single gather, and reported in the schedule record.
    import zbuf.compile
    import zbuf.shard
    from zbuf.compile.report import clear_records, schedule_report

    model = zbuf.shard(_net(hidden=64))
    largest = max(s.gathered_nbytes for s in model._zbuf_root.specs.values())
    clear_records()
    compiled = zbuf.compile(model, budget_bytes=1, inner="aot_eager")
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    records = schedule_report(model)
    assert records, "the compiled graph was not planned"
    for rec in records:
        assert rec.requested_budget_bytes == 1
        assert rec.budget_bytes == rec.floor_bytes >= largest


def test_compile_rejects_non_positive_budget():
    import zbuf.compile

    with pytest.raises(ValueError, match="budget_bytes=0 must be a positive int"):
        zbuf.compile.CompileOptions(budget_bytes=0)


# ---------------------------------------------------------------------------------------------
# the model changes after shard(); devices


def test_checkpoint_refuses_parameter_added_after_shard(tmp_path):
    model, opt = _sharded()
    model.add_module("late", nn.Linear(3, 3))
    with pytest.raises(ckpt.LayoutError, match=r"\['late.weight', 'late.bias'\].*added or replaced after zbuf.shard"):
        ckpt.save_checkpoint(tmp_path / "c", model, opt, step=1)
    assert not (tmp_path / "c").exists()


def test_forward_refuses_parameter_added_after_shard():
    import zbuf.shard

    model, _ = _sharded()
    model[0].register_parameter("late", nn.Parameter(torch.randn(3)))
    # otherwise each rank trains its own copy of 'late' with unsynchronised gradients
    with pytest.raises(zbuf.ShardingError, match="after zbuf.shard"):
        model(torch.randn(2, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_shard_to_cuda_without_gpu():
    import zbuf.shard

    with pytest.raises(zbuf.ShardingError, match="(?i)cuda"):
        zbuf.shard(_net(), device="cuda")


def test_checkpoint_refuses_unsharded_model(tmp_path):
    with pytest.raises(ckpt.LayoutError, match=r"not a zbuf-sharded model.*call zbuf.shard\(model\) first"):
        ckpt.save_checkpoint(tmp_path / "c", _net(), None, step=0)


def test_checkpoint_refuses_foreign_optimizer(tmp_path):
    model, _ = _sharded()
    other = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    with pytest.raises(ckpt.LayoutError, match="not a sharded parameter of this model"):
        ckpt.save_checkpoint(tmp_path / "c", model, other, step=0)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_checkpoint_bad_step(tmp_path, step):
    model, opt = _sharded()
    with pytest.raises(ckpt.LayoutError, match="step must be a non-negative int"):
        ckpt.save_checkpoint(tmp_path / "c", model, opt, step=step)


def test_checkpoint_extra_must_load_safely(tmp_path):
    model, opt = _sharded()

    class Custom:
        pass

    with pytest.raises(ckpt.LayoutError, match=r"extra cannot be stored.*weights_only=True"):
        ckpt.save_checkpoint(tmp_path / "c", model, opt, step=0, extra={"obj": Custom()})
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------
# damaged checkpoints and checkpoints of other models: nothing is loaded


@pytest.fixture()
def saved(tmp_path):
    model, opt = _sharded()
    path = ckpt.save_checkpoint(tmp_path / "good", model, opt, step=7, extra={"lr": 0.5})
    return path


def _fresh():
    model, opt = _sharded()
    return model, opt, _state(model, opt)


def _data_file(path):
    return next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")


def test_roundtrip_in_process(saved):
    model, opt, expected = _fresh()  # deterministic: the state that was saved
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for st in opt.state.values():
            for v in st.values():
                v.add_(1.0)
    assert not _unchanged(expected, model, opt)
    info = ckpt.load_checkpoint(saved, model, opt)
    assert (info.step, info.world_size, info.extra) == (7, 1, {"lr": 0.5})
    assert _unchanged(expected, model, opt)


def test_truncated_data_file(saved):
    f = _data_file(saved)
    f.write_bytes(f.read_bytes()[:-100])
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"damaged, nothing was loaded: {f.name} is truncated.*Load an earlier checkpoint"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_corrupted_data_file(saved):
    f = _data_file(saved)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{f.name} is corrupted: CRC-32"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_missing_data_file(saved):
    f = _data_file(saved)
    f.unlink()
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{f.name} is missing"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_corrupted_dcp_metadata_without_checksums(saved):
    # verify=False skips the CRCs; a broken .metadata is still caught before the model is touched
    meta = saved / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"DCP's \.metadata cannot be read"):
        ckpt.load_checkpoint(saved, model, opt, verify=False)
    assert _unchanged(before, model, opt)


def test_unfinished_save(saved):
    (saved / MANIFEST_NAME).unlink()  # what a save killed before its commit looks like
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"not a complete zbuf checkpoint.*never finished"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_garbled_manifest(saved):
    (saved / MANIFEST_NAME).write_text("{not json")
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match="not valid JSON"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_nothing_at_path(tmp_path):
    model, opt, _ = _fresh()
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no zbuf checkpoint at"):
        ckpt.load_checkpoint(tmp_path / "nowhere", model, opt)


def test_checkpoint_of_a_wider_model(saved):
    import zbuf.shard

    model = zbuf.shard(_net(hidden=6))
    opt = torch.optim.AdamW(model.parameters())
    before = _state(model, opt)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"shape mismatch: 0.weight: checkpoint \(5, 4\), model \(6, 4\)"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_checkpoint_of_a_model_with_other_layers(saved):
    import zbuf.shard

    torch.manual_seed(0)
    model = zbuf.shard(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 3, bias=False)))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _state(model, sgd)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"parameters missing from the checkpoint: 3.weight"):
        ckpt.load_checkpoint(saved, model)
    assert _unchanged(before, model, sgd)

    smaller = zbuf.shard(nn.Sequential(nn.Linear(4, 5)))
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"unexpected parameters in the checkpoint \(not in this model\): 2.weight, 2.bias"):
        ckpt.load_checkpoint(saved, smaller)


def test_checkpoint_with_another_optimizer(saved):
    model, _, _ = _fresh()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointMismatchError, match="optimizer class: checkpoint AdamW, given SGD"):
        ckpt.load_checkpoint(saved, model, sgd)

    params = list(model.parameters())
    regrouped = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])
    with pytest.raises(ckpt.CheckpointMismatchError, match="optimizer param groups: checkpoint 1, given 2"):
        ckpt.load_checkpoint(saved, model, regrouped)

    # the model alone still loads
    info = ckpt.load_checkpoint(saved, model)
    assert info.has_optimizer and info.step == 7


def test_model_only_checkpoint_into_optimizer(tmp_path):
    model, opt = _sharded()
    path = ckpt.save_checkpoint(tmp_path / "m", model, None, step=3)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"has no optimizer state.*optimizer=None to load only the model"):
        ckpt.load_checkpoint(path, model, opt)
    assert ckpt.load_checkpoint(path, model).step == 3


def test_format_version_from_the_future(saved):
    mpath = saved / MANIFEST_NAME
    manifest = json.loads(mpath.read_text())
    manifest["version"] = 99
    mpath.write_text(json.dumps(manifest))
    model, opt, before = _fresh()
    with pytest.raises(ckpt.CheckpointCorruptError, match="format version is 99; this zbuf reads version 1"):
        ckpt.load_checkpoint(saved, model, opt)
    assert _unchanged(before, model, opt)


def test_latest_skips_unfinished_and_prune_keeps_newest(tmp_path):
    model, opt = _sharded()
    root = tmp_path / "root"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(ckpt.checkpoint_path(root, step), model, opt, step=step)
    shutil.copytree(ckpt.checkpoint_path(root, 3), ckpt.checkpoint_path(root, 4))
    (ckpt.checkpoint_path(root, 4) / MANIFEST_NAME).unlink()  # an unfinished step 4
    assert ckpt.latest_checkpoint(root) == ckpt.checkpoint_path(root, 3)
    assert ckpt.load_checkpoint(root, model, opt).step == 3
    assert ckpt.prune(root, keep_last=2) == [ckpt.checkpoint_path(root, 1)]
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]


# ---------------------------------------------------------------------------------------------
# after the process group is gone (last: it destroys the module's group and makes a new one)


def test_call_after_process_group_destroyed():
    import gc
    import weakref

    import zbuf
    import zbuf.shard

    model = zbuf.shard(_net())
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 4)
    compiled(x)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    try:
        # The live model does not keep the group (and gloo's threads) alive: [Note: a model does
        # not keep its group alive] in shard_state.py.
        gc.collect()
        assert group() is None
        for fn in (model, compiled):
            with pytest.raises(RuntimeError, match="destroyed"):
                fn(x)
        with pytest.raises(zbuf.ShardingError, match="destroy_process_group"):
            zbuf.clip_grad_norm_(model, 1.0)
    finally:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
