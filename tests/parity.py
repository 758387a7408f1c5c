"""What the parity tests share: relative error against a reference, token batches, the plain
training loop the single-process compile tests compare engines with, and one legal combination of
modes trained against the unsharded model on a device (tests/test_modes.py on the CPU,
tests/gpu/test_modes_gpu.py on CUDA)."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (0-safe)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def token_batches(n: int = 3, vocab: int = 97, rows: int = 2, length: int = 12,
                  seed: int = 5) -> list[torch.Tensor]:
    """``n`` batches of ``rows`` rows of ``length`` tokens (inputs ``[:, :-1]``, targets
    ``[:, 1:]``), the same on every call."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, length), generator=g) for _ in range(n)]


def decoder_loss(step_fn, tokens):
    """The built-in decoder's next-token loss over ``tokens``."""
    from zbuf.models import loss

    return loss(step_fn, tokens[:, :-1], tokens[:, 1:])


def hf_loss(step_fn, tokens):
    """A Hugging Face causal LM's own loss over ``tokens``. Training keeps no KV cache: a cache
    is per-layer state that the layer reads, so with one each block would be a frame of its
    own."""
    return step_fn(input_ids=tokens, labels=tokens, use_cache=False).loss


def train_adamw(step_fn, model, batches, opt=None, after_step=None,
                loss_of=decoder_loss) -> list[float]:
    """AdamW (lr 1e-3 unless ``opt`` is given) over ``batches`` through ``step_fn`` (the model, or
    its compiled form), each step's loss ``loss_of(step_fn, tokens)``; ``after_step()`` runs
    after each optimizer step. Returns the losses."""
    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches:
        out = loss_of(step_fn, tokens)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        losses.append(out.item())
    return losses


def tiny_qwen3(checkpointed: bool, layers: int = 3):
    """A Hugging Face Qwen3 of ``layers`` layers small enough for CPU parity tests (seed 0), its
    layers checkpointed (non-reentrant) when ``checkpointed``."""
    import transformers

    from zbuf.train.hf import checkpoint_layers

    cfg = transformers.Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=44, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=True, attention_dropout=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    if checkpointed:
        checkpoint_layers(model, {"use_reentrant": False})
    return model


def mode_name(modes) -> str:
    """A combination's test id: its structure, recompute and the modes switched on."""
    on = [n for n in ("optimizer_in_backward", "offload_optimizer") if getattr(modes, n)]
    return "-".join([modes.structure, modes.recompute, *on])


def modes_model(checkpointed: bool = True):
    """The two-layer decoder the modes are trained on (seed 0), its blocks checkpointed as the
    user would when ``checkpointed``."""
    from zbuf.models import apply_activation_checkpointing, build_model, resolve_config

    cfg = resolve_config("tiny").replace(num_layers=2, vocab_size=97, hidden_size=32,
                                         ffn_hidden_size=64, head_dim=8)
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_activation_checkpointing(model, checkpointed)
    return model


def modes_train_as_unsharded(modes, device: torch.device, inner: str) -> None:
    """``modes`` (a legal ``zbuf.compile.modes.Modes``) through ``zbuf.compile(model,
    optimizer=opt)`` on ``device`` (one rank) trains as the unsharded model does with plain
    AdamW: the same losses and parameters, to float rounding. The learning rate warms up from 0
    (Adam's first step turns rounding into lr-sized steps: [Note: first Adam step] in
    test_compile_dist.py)."""
    import copy

    import zbuf.compile
    from zbuf.shard import shard
    from zbuf.state_dict import full_state_dict

    base = modes_model().to(device)
    batches = [b.to(device) for b in token_batches(3)]

    def run(step_fn, model, opt):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
        return train_adamw(step_fn, model, batches, opt=opt, after_step=sched.step)

    reference = copy.deepcopy(base)
    expected = run(reference, reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    model = shard(copy.deepcopy(base))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = zbuf.compile(model, optimizer=opt, inner=inner, fullgraph=True,
                            structure=modes.structure, recompute=modes.recompute,
                            optimizer_in_backward=modes.optimizer_in_backward,
                            offload_optimizer=modes.offload_optimizer)
    losses = run(compiled, model, opt)
    zbuf.compile.step_memory_of(compiled).detach()
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    got = full_state_dict(model)
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(got[name].to(want.device), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
