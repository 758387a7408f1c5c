"""zbuf.models: presets, parameter counts, numerics against Hugging Face Qwen3, compile, AC."""

import pytest
import torch

from zbuf.models import (PRESETS, Decoder, ModelConfig, apply_activation_checkpointing,
                         build_model, count_params, loss, resolve_config)

SMALL = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_hidden_size=96, rope_theta=10_000.0)


def test_presets_have_public_qwen3_shapes_and_counts():
    assert set(PRESETS) == {"tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                            "qwen3-14b", "qwen3-32b"}
    # Published sizes: 0.6B = 596,049,920 parameters (tied), 8B = 8.19e9, 14B = 14.8e9.
    expected = {"qwen3-0.6b": (0.596e9, 0.597e9), "qwen3-1.7b": (1.70e9, 1.73e9),
                "qwen3-4b": (4.0e9, 4.05e9), "qwen3-8b": (8.15e9, 8.25e9),
                "qwen3-14b": (14.7e9, 14.85e9), "qwen3-32b": (32.7e9, 32.8e9),
                "tiny": (1e6, 5e6)}
    for name, (lo, hi) in expected.items():
        model = build_model(name, device="meta")
        n = count_params(model)
        assert lo <= n <= hi, (name, n)
        assert n == PRESETS[name].num_params(), name
        assert all(p.is_meta for p in model.parameters())
    assert count_params(build_model("qwen3-0.6b", device="meta")) == 596_049_920
    q8 = PRESETS["qwen3-8b"]
    assert (q8.hidden_size, q8.num_layers, q8.num_heads, q8.num_kv_heads, q8.head_dim,
            q8.ffn_hidden_size, q8.vocab_size, q8.tie_embeddings, q8.rope_theta) == (
        4096, 36, 32, 8, 128, 12288, 151936, False, 1e6)
    q32 = PRESETS["qwen3-32b"]  # Hugging Face Qwen/Qwen3-32B/config.json
    assert (q32.hidden_size, q32.num_layers, q32.num_heads, q32.num_kv_heads, q32.head_dim,
            q32.ffn_hidden_size, q32.vocab_size, q32.tie_embeddings) == (
        5120, 64, 64, 8, 128, 25600, 151936, False)
    assert q32.num_params() == 32_762_123_264


def _materialise_qwen3_32b_as_rank0_of_8():
    """qwen3-32b (one of its 64 layers: every layer is alike) built on the meta device and
    sharded as rank 0 of 8 over the fake group, as ``--simulate-world 8`` does: the most full
    (unsharded) parameter bytes that exist at once, the shard bytes, the model's bytes."""
    import torch

    import zbuf
    from zbuf.train.simulate import simulate_world

    model = build_model(PRESETS["qwen3-32b"].replace(num_layers=1), device="meta")
    whole = sum(p.numel() * 4 for p in model.parameters())
    most = [0]

    def init_fn(sub):
        # What is materialised and not yet cut to a shard: the 2-D (full) weights.
        full = sum(p.numel() * p.element_size() for p in model.parameters()
                   if not p.is_meta and p.dim() == 2)
        most[0] = max(most[0], full)
        # Not initialised: writing the 3.1 GB embedding cost 20 s of the test's 37, and what
        # is measured is what exists at once, not its values.

    with simulate_world(8):
        zbuf.shard(model, device=torch.device("cpu"), init_fn=init_fn)
        shards = sum(p.numel() * p.element_size() for p in model.parameters())
        meta_left = any(p.is_meta for p in model.parameters())
    return most[0], shards, whole, meta_left


def test_qwen3_32b_materialises_shard_by_shard_as_rank0_of_8():
    """[Note: materialising meta modules]: rank 0 of 8 never holds more than one submodule's
    full weights (the 3.1 GB embedding), not the model (8.2 GB at one layer; 131 GB at 64)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        most, shards, whole, meta_left = pool.apply(_materialise_qwen3_32b_as_rank0_of_8)
    embedding = PRESETS["qwen3-32b"].vocab_size * PRESETS["qwen3-32b"].hidden_size * 4
    assert not meta_left
    assert most == embedding < whole / 2
    assert whole / 8 <= shards < whole / 8 + 8 * 4 * 16  # ceil(numel / 8) per parameter


def test_tied_model_has_one_embedding_parameter():
    tied = build_model(SMALL.replace(tie_embeddings=True))
    untied = build_model(SMALL)
    assert tied.lm_head is None and "lm_head.weight" not in tied.state_dict()
    assert "lm_head.weight" in untied.state_dict()
    assert count_params(untied) - count_params(tied) == SMALL.vocab_size * SMALL.hidden_size


@pytest.mark.parametrize("changes, needle", [
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(head_dim=15), "even"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(vocab_size=1.5), "vocab_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(tie_embeddings="yes"), "tie_embeddings"),
])
def test_config_validation(changes, needle):
    with pytest.raises(ValueError, match=needle):
        SMALL.replace(**changes)


def test_unknown_preset_and_bad_input_shapes():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'.*tiny"):
        resolve_config("qwen9")
    with pytest.raises(TypeError):
        resolve_config(3)
    model = build_model(SMALL)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(SMALL.replace(max_seq_len=4))(torch.zeros(1, 5, dtype=torch.long))


def test_meta_build_materialises_to_the_eager_model():
    torch.manual_seed(3)
    eager = build_model(SMALL)
    meta = build_model(SMALL, device="meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), meta.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_causal_and_dtype():
    torch.manual_seed(0)
    model = build_model(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % SMALL.vocab_size
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, SMALL.vocab_size)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    bf = build_model(SMALL, dtype=torch.bfloat16)
    assert bf(tokens).dtype == torch.bfloat16
    assert loss(bf, tokens, tokens).dtype == torch.float32


@pytest.mark.parametrize("tie", [False, True])
def test_matches_hugging_face_qwen3(tie):
    transformers = pytest.importorskip("transformers")
    cfg = SMALL.replace(tie_embeddings=tie)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=tie, max_position_embeddings=cfg.max_seq_len,
        attention_dropout=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    ours = build_model(cfg).eval()
    hf_sd = hf.state_dict()
    mapped = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    if tie:
        mapped.pop("lm_head.weight", None)
    missing, unexpected = ours.load_state_dict(mapped, strict=True)
    assert not missing and not unexpected
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_same_gradients_and_fullgraph_compile():
    torch.manual_seed(0)
    model = build_model(SMALL.replace(tie_embeddings=True))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    targets = torch.roll(tokens, -1, dims=1)

    def grads(m):
        m.zero_grad(set_to_none=True)
        value = loss(m, tokens, targets)
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    ref_loss, ref = grads(model)
    apply_activation_checkpointing(model)
    assert all(layer.activation_checkpointing for layer in model.layers)
    ac_loss, ac = grads(model)
    torch.testing.assert_close(ac_loss, ref_loss, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(ac[name], ref[name], rtol=1e-6, atol=1e-7)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    c_loss, cg = grads(compiled)
    torch.testing.assert_close(c_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(cg[name.removeprefix("_orig_mod.")] if name in cg else
                                   cg["_orig_mod." + name], ref[name], rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="Decoder"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))


def test_tiny_learns_the_default_synthetic_task():
    from zbuf.train.data import Task, global_batch

    torch.manual_seed(0)
    model = build_model("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        tokens, targets = global_batch(Task.STRIDE, 0, step, 8, 64, 256)
        value = loss(model, tokens, targets)
        losses.append(value.item())
        opt.zero_grad()
        value.backward()
        opt.step()
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_selective_checkpointing_recomputes_every_second_matmul():
    """torchtitan's op-level policy ([Note: selective checkpointing]): same gradients as no
    checkpointing, eager and compiled; backward re-runs k, o and up of each block (every second
    matmul) where full checkpointing re-runs six (all but down: non-reentrant checkpointing stops
    recomputing once backward has what it needs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    targets = torch.roll(tokens, -1, dims=1)

    def run(m):
        m.zero_grad(set_to_none=True)
        value = loss(m, tokens, targets)
        with CountMatmuls() as counter:
            value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, counter.mm

    ref_loss, ref, mm_none = run(model)
    apply_activation_checkpointing(model, "full")
    *_, mm_full = run(model)
    apply_activation_checkpointing(model, "selective")
    assert all(layer.activation_checkpointing == "selective" for layer in model.layers)
    sel_loss, sel, mm_sel = run(model)
    layers = SMALL.num_layers
    assert (mm_full - mm_none, mm_sel - mm_none) == (6 * layers, 3 * layers)
    torch.testing.assert_close(sel_loss, ref_loss, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(sel[name], ref[name], rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()
    c_loss, cg, _ = run(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(c_loss, ref_loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mode 'some'"):
        apply_activation_checkpointing(model, "some")


def test_cross_entropy_matches_the_fp32_formula_without_fp32_logits(monkeypatch):
    """[Note: lean cross-entropy]: value and gradient of F.cross_entropy on fp32-upcast logits,
    in chunks of rows, with ignored targets; eager and compiled; bf16 logits get a bf16 gradient."""
    import torch.nn.functional as F

    import zbuf.models as zm

    monkeypatch.setattr(zm, "CROSS_ENTROPY_CHUNK_BYTES", 4 * 50 * 4)  # 4 rows per chunk
    torch.manual_seed(0)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :3] = -100
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = torch.randn(3, 7, 50, dtype=dtype, requires_grad=True)
        ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        (ref_grad,) = torch.autograd.grad(ref, logits)
        for fn in (zm.cross_entropy, torch.compile(zm.cross_entropy, backend="aot_eager")):
            value = fn(logits, targets)
            (grad,) = torch.autograd.grad(value, logits)
            assert value.dtype == torch.float32 and grad.dtype == dtype
            torch.testing.assert_close(value, ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=tol, atol=tol)
    assert torch.isnan(zm.cross_entropy(torch.randn(2, 5), torch.full((2,), -100)))
