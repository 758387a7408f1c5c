"""[Note: the logits are never whole]: the fused output projection and loss against
``F.cross_entropy(F.linear(h, W))``, eager, compiled and inside the built-in decoder."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import zbuf.linear_cross_entropy as lce
from zbuf.linear_cross_entropy import linear_cross_entropy
from zbuf.models import Decoder, ModelConfig, build_model, loss

SMALL = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, ffn_hidden_size=48, rope_theta=10_000.0)


def _reference(hidden, weight, targets, ignore_index=-100):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), width=st.integers(1, 24), vocab=st.integers(2, 70),
       columns=st.integers(1, 80), ignored=st.floats(0.0, 0.9), seed=st.integers(0, 2**16))
def test_value_and_gradients_match_the_unfused_loss_in_fp32(tokens, width, vocab, columns,
                                                           ignored, seed):
    """Any slicing of the vocabulary (one column to all of it), any share of ignored tokens."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=g, dtype=torch.float64).float()
    weight = torch.randn(vocab, width, generator=g).mul_(0.5)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[torch.rand(tokens, generator=g) < ignored] = -100
    targets[0] = vocab - 1  # at least one valid token, in the last slice
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    ref = _reference(hidden, weight, targets)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    total, lse = torch.ops.zbuf_fused.linear_cross_entropy(hidden, weight, targets, -100, columns)
    value = total / (targets != -100).sum()
    grads = torch.autograd.grad(value, (hidden, weight))
    assert not lse.requires_grad
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_gradients_have_the_operands_dtype_and_the_unfused_accuracy():
    torch.manual_seed(0)
    hidden = torch.randn(2, 64, 48).bfloat16().requires_grad_(True)
    weight = (torch.randn(300, 48) * 0.2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 300, (2, 64))
    ref = _reference(hidden, weight, targets)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    value = linear_cross_entropy(hidden, weight, targets)
    grads = torch.autograd.grad(value, (hidden, weight))
    assert value.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(value, ref, rtol=1e-3, atol=1e-3)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-4)


def test_all_ignored_is_nan_and_mixed_dtypes_name_the_fix():
    w = torch.randn(5, 3)
    assert torch.isnan(linear_cross_entropy(torch.randn(2, 3), w, torch.full((2,), -100)))
    with pytest.raises(TypeError, match="bfloat16.*float32.*cast one of them"):
        linear_cross_entropy(torch.randn(2, 3).bfloat16(), w, torch.zeros(2, dtype=torch.long))


def test_under_autocast_the_operands_take_autocasts_dtype():
    torch.manual_seed(0)
    hidden, weight = torch.randn(8, 16), torch.randn(40, 16)
    targets = torch.randint(0, 40, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = linear_cross_entropy(hidden, weight, targets)
    want = _reference(hidden.bfloat16(), weight.bfloat16(), targets)
    torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_decoder_loss_compiles_as_one_opaque_operator_each_way(backend, monkeypatch):
    """Decoder(tokens, targets) is the logits path's loss; compiled, the forward and backward
    graphs hold the two operators and no [tokens, vocab] tensor."""
    from torch._functorch.aot_autograd import aot_module_simplified

    monkeypatch.setattr(lce, "LOGITS_SLICE_BYTES", 4 * 16 * 10)  # 10 columns a slice
    torch.manual_seed(0)
    model = build_model(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
    targets = torch.randint(0, SMALL.vocab_size, (2, 8))
    targets[1, :3] = -100
    ref = loss(model, tokens, targets)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))

    graphs = []

    def capture(gm, example_inputs):
        def keep(name):
            def compiler(g, _inputs):
                graphs.append((name, g))
                return g
            return compiler
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"),
                                     bw_compiler=keep("backward"))

    torch._dynamo.reset()
    for fn in (torch.compile(model, backend=capture, fullgraph=True),
               torch.compile(model, backend=backend, fullgraph=True)):
        value = fn(tokens, targets, -100)
        grads = torch.autograd.grad(value, list(model.parameters()))
        torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ops = {name: [n.target for n in g.graph.nodes if n.op == "call_function"]
           for name, g in graphs}
    assert torch.ops.zbuf_fused.linear_cross_entropy.default in ops["forward"]
    assert torch.ops.zbuf_fused.linear_cross_entropy_backward.default in ops["backward"]
    for _, g in graphs:
        for n in g.graph.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert SMALL.vocab_size not in val.shape or val.dim() < 2 or (
                    val.shape[-1] == SMALL.hidden_size), (n, tuple(val.shape))


def test_the_cost_model_counts_the_operators_workspace_and_flops():
    from torch.fx.experimental.proxy_tensor import make_fx

    from zbuf.compile.graph_info import activation_profile, node_flops

    tokens, width, vocab = 64, 16, 50
    gm = make_fx(lambda h, w, t: torch.ops.zbuf_fused.linear_cross_entropy(h, w, t, -100, 7),
                 tracing_mode="fake")(torch.empty(tokens, width), torch.empty(vocab, width),
                                      torch.zeros(tokens, dtype=torch.long))
    nodes = list(gm.graph.nodes)
    op = next(n for n in nodes if n.target is torch.ops.zbuf_fused.linear_cross_entropy.default)
    workspace = lce.workspace_bytes(op)
    assert workspace == tokens * 7 * (4 + 2 * 4) + 3 * tokens * 4
    assert node_flops(op) == 2.0 * tokens * width * vocab  # the logits' product
    profile = activation_profile(gm.graph, inputs=False)
    at = nodes.index(op)
    outputs = 4 + tokens * 4  # the total and the log-sum-exp, from their getitems on
    assert profile[at] == workspace
    assert profile[at + 1] <= outputs
