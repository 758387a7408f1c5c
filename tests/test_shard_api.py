"""``zbuf.shard`` in one process (a 1-rank gloo group): layout, access, errors, meta, guards, dtypes."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed as dist
from torch import nn

import zbuf.runtime
from test_shard_parity import ParityNet
from zbuf.shard import ShardingError, op_counts, shard, sharded_parameters
from zbuf.state_dict import full_state_dict


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


def test_shards_keep_names_keys_and_module_types():
    torch.manual_seed(0)
    ref = ParityNet()
    model = shard(copy.deepcopy(ref))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.dim() == 1
    assert isinstance(model.embed, nn.Embedding) and type(model.embed).__name__ == "ZbufEmbedding"
    # the property gathers the full tensor, fresh memory, equal to the original
    for (fqn, sub, name, shard_p, spec) in sharded_parameters(model):
        full = getattr(sub, name)
        torch.testing.assert_close(full, dict(ref.named_parameters(remove_duplicate=False))[fqn], rtol=0, atol=0)
        assert full.untyped_storage().data_ptr() != shard_p.untyped_storage().data_ptr()
    # tied: one shard under both names, frozen stays frozen, buffers untouched
    assert model.head._parameters["weight"] is model.embed._parameters["weight"]
    assert not model.frozen._parameters["weight"].requires_grad
    assert model.scale.shape == ref.scale.shape
    torch.testing.assert_close(full_state_dict(model), ref.state_dict(), rtol=0, atol=0)


def test_tied_weight_reduces_into_one_gradient_frozen_gets_none():
    torch.manual_seed(0)
    ref = ParityNet()
    model = shard(copy.deepcopy(ref))
    tokens = torch.randint(0, 37, (3, 5))
    before = op_counts(model)["reduce_scatter"]
    model(tokens).sum().backward()
    ref(tokens).sum().backward()
    # one per trainable parameter: the tied embedding/head once ([Note: reduce once]) + 2 blocks x 4
    assert op_counts(model)["reduce_scatter"] - before == 9
    emb = model.embed._parameters["weight"]
    torch.testing.assert_close(emb.grad.view(ref.embed.weight.shape), ref.embed.weight.grad, rtol=1e-6, atol=1e-7)
    assert model.frozen._parameters["weight"].grad is None


def test_mistakes_get_clear_errors(monkeypatch):
    torch.manual_seed(0)
    model = shard(ParityNet())
    with pytest.raises(ShardingError, match="already sharded"):
        shard(model)
    with pytest.raises(ShardingError, match="already sharded"):
        shard(model.blocks[0])
    with pytest.raises(ShardingError, match="cannot assign to 'weight'"):
        model.head.weight = nn.Parameter(torch.zeros(37, 13))

    class WithCounter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.steps = nn.Parameter(torch.zeros((), dtype=torch.int64), requires_grad=False)

    with pytest.raises(ShardingError, match="'steps' has dtype torch.int64.*register_buffer"):
        shard(WithCounter(), reduce_dtype=torch.float32)
    shard(WithCounter())  # without mixed precision an integer (frozen) parameter is fine
    with pytest.raises(ShardingError, match="param_dtype must be a floating-point"):
        shard(nn.Linear(2, 2), param_dtype=torch.int8)
    with pytest.raises(ShardingError, match="takes an nn.Module"):
        shard(torch.zeros(3))
    with pytest.raises(ShardingError, match="shard the original module first"):
        shard(torch.compile(nn.Linear(2, 2), backend="eager"))
    cuda_only = dist.new_group([0], backend="cuda:gloo")
    with pytest.raises(ShardingError, match=r"on cpu, but the sharding group's backend 'cuda:gloo' only handles \['cuda'\]"):
        shard(nn.Linear(2, 2), cuda_only)
    with pytest.raises(ShardingError, match="must be a torch.distributed.ProcessGroup"):
        shard(nn.Linear(2, 2), "world")
    lin = nn.Linear(2, 2)
    lin(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ShardingError, match="already has a .grad"):
        shard(lin)
    with pytest.raises(ShardingError, match="device=meta but the module's materialised tensors are on cpu"):
        shard(nn.Linear(2, 2), device="meta")
    with torch.device("meta"):
        meta_net = ParityNet()  # its own buffer and Block's parameter: no reset_parameters
    with pytest.raises(ShardingError, match=r"submodule '<root>' \(ParityNet\).*\(scale\).*no reset_parameters.*init_fn"):
        shard(meta_net, device="cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ShardingError, match="init_process_group"):
        shard(nn.Linear(2, 2))


def test_meta_module_materialises_per_submodule_like_eager_build():
    from zbuf.models import build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=2, vocab_size=101)
    torch.manual_seed(5)
    eager = build_model(cfg)
    torch.manual_seed(5)
    meta = build_model(cfg, device="meta")
    model = shard(meta, device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(full_state_dict(model), eager.state_dict(), rtol=0, atol=0)

    # a module without reset_parameters initialises through init_fn
    with torch.device("meta"):
        net = ParityNet()
    seen = []

    def init_fn(module):
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)
        for b in module.buffers(recurse=False):
            b.fill_(2.0)

    model = shard(net, device="cpu", init_fn=init_fn)
    sd = full_state_dict(model)
    assert all(torch.all(v == (2.0 if k == "scale" else 0.5)) for k, v in sd.items())
    # 2 blocks x 2 + frozen; the head holds only the tied embedding, already materialised
    assert seen.count("Linear") == 5 and "Embedding" in seen and "ParityNet" in seen


def test_guard_evaluation_never_gathers():
    torch.manual_seed(0)
    model = shard(ParityNet())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, 37, (2, 5))
    with torch.no_grad():
        before = op_counts(model)["all_gather"]
        model(tokens)
        per_call = op_counts(model)["all_gather"] - before
        compiled(tokens)  # compiles
        for _ in range(3):
            before = op_counts(model)["all_gather"]
            compiled(tokens)  # guards evaluated, graph run
            assert op_counts(model)["all_gather"] - before == per_call


def test_param_dtype_gathers_and_travels_in_low_precision():
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    model = shard(copy.deepcopy(ref), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert model._parameters["weight"].dtype == torch.float32
    before = op_counts(model)["all_gather_bytes"]
    w = model.weight
    assert w.dtype == torch.bfloat16 and w.shape == (8, 16)
    assert op_counts(model)["all_gather_bytes"] - before == 8 * 16 * 2
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    g = model._parameters["weight"].grad
    assert g.dtype == torch.float32 and g.shape == (128,)
    torch.testing.assert_close(g.view(8, 16), (torch.ones(4, 8).t() @ x.float()), rtol=1e-2, atol=1e-2)


def test_release_returns_the_block_and_rejects_foreign_tensors():
    from zbuf.pool import GatherBufferPool

    pool = GatherBufferPool("cpu")
    model = shard(nn.Linear(8, 8), pool=pool)
    w = model.weight
    pool_id = zbuf.runtime.pool_id_of(pool)  # the id zbuf.shard gave it
    assert pool.stats().checked_out == 1
    torch.ops.zbuf.release(w, pool_id)
    assert pool.stats().checked_out == 0
    with pytest.raises(ValueError, match="not a live buffer"):
        torch.ops.zbuf.release(w, pool_id)
    with pytest.raises(ValueError, match="not a live buffer"):
        torch.ops.zbuf.release(torch.zeros(3), pool_id)


def test_custom_ops_trace_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s = torch.empty(7)
        full = torch.ops.zbuf.all_gather(s, 0, [3, 4], "0", torch.bfloat16, None)
        assert full.shape == (3, 4) and full.dtype == torch.bfloat16 and full.is_contiguous()
        g = torch.ops.zbuf.reduce_scatter(full, 0, 7, "0", torch.float32, torch.float32)
        assert g.shape == (7,) and g.dtype == torch.float32
    torch.library.opcheck(torch.ops.zbuf.reduce_scatter.default,
                          (torch.randn(3, 4), 0, 12, dist.group.WORLD.group_name, None, torch.float32))


def test_a_models_pool_does_not_outlive_the_model():
    """The pool registry ([Note: pool ids]) holds pools weakly: a model's own pool (each engine
    of ``zbuf bench`` makes one) is freed with the model, and its id names no pool after."""
    import gc
    import weakref

    from zbuf.pool import GatherBufferPool
    from zbuf.shard import root_of

    pool = GatherBufferPool("cpu")
    model = shard(nn.Linear(8, 8), pool=pool)
    model(torch.randn(2, 8)).sum().backward()
    pool_id = next(iter(root_of(model).specs.values())).pool_id
    assert zbuf.runtime.pool_of(pool_id, torch.zeros(1)) is pool
    alive = weakref.ref(pool)
    del model, pool
    gc.collect()
    assert alive() is None
    with pytest.raises(ValueError, match="no live gather-buffer pool has id"):
        zbuf.runtime.pool_of(pool_id, torch.zeros(1))


def test_two_models_in_one_process_keep_separate_counts():
    """[Note: counts live with their model]: two models sharded in one process, on the same
    (default) pool, each count only their own gathers and reduce-scatters, and a model's counts
    are freed with it."""
    import gc
    import weakref

    from zbuf.shard import root_of

    a = shard(nn.Linear(8, 8))
    b = shard(nn.Linear(16, 4), param_dtype=torch.bfloat16)
    assert root_of(a).pool is root_of(b).pool
    a(torch.randn(2, 8)).sum().backward()
    # weight and bias gathered once and reduced once each, fp32 at world 1: (64 + 8) * 4 bytes
    after_a = op_counts(a)
    assert after_a == {"all_gather": 2, "all_gather_bytes": 288,
                       "reduce_scatter": 2, "reduce_scatter_bytes": 288}
    assert op_counts(b) == {}

    b(torch.randn(3, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert op_counts(a) == after_a
    # bf16 both ways (no reduce_dtype): (64 + 4) * 2 bytes
    after_b = op_counts(b)
    assert after_b == {"all_gather": 2, "all_gather_bytes": 136,
                       "reduce_scatter": 2, "reduce_scatter_bytes": 136}
    assert op_counts(torch.compile(b, backend="aot_eager")) == after_b  # the accessor sees through

    counts = weakref.ref(root_of(a).counters)
    del a
    gc.collect()
    assert counts() is None


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), pad=st.integers(0, 5),
       src=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       dst=st.sampled_from([torch.float32, torch.bfloat16, None]))
def test_reduce_scatter_casts_and_pads_bit_for_bit(shape, pad, src, dst):
    """[Note: the gradient's cast]: the gradient reaches the collective as ``Tensor.to`` casts
    it, bit for bit, with zeros in the padding (one rank: the reduce-scatter is a copy)."""
    grad = (torch.randn(shape) * 1e3).to(src)
    grad.view(-1)[0] = float("-inf")
    numel = grad.numel()
    out = torch.ops.zbuf.reduce_scatter(grad, 0, numel + pad, dist.group.WORLD.group_name, dst,
                                        torch.float32)
    want = torch.cat([grad.reshape(-1).to(dst or src), torch.zeros(pad, dtype=dst or src)])
    assert torch.equal(out, want.to(torch.float32))
