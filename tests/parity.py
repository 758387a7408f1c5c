"""What the parity tests share: relative error against a reference, token batches, and the plain
training loop the single-process compile tests compare engines with."""

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


def train_adamw(step_fn, model, batches, opt=None, after_step=None) -> list[float]:
    """AdamW (lr 1e-3 unless ``opt`` is given) over ``batches`` through ``step_fn`` (the model, or
    its compiled form); ``after_step()`` runs after each optimizer step. Returns the losses."""
    from zbuf.models import loss

    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches:
        out = loss(step_fn, tokens[:, :-1], tokens[:, 1:])
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
