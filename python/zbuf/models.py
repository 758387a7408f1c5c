"""The built-in decoder: a Qwen3-shaped transformer for demos, tests and benchmarks.

Architecture (as in the public Qwen3 dense models): token embedding, ``num_layers`` pre-norm
blocks of GQA attention (per-head RMSNorm on q and k, rotary position embedding, causal
``F.scaled_dot_product_attention``) and a SwiGLU MLP, a final RMSNorm and an output projection
that is optionally tied to the embedding. No biases anywhere.

Choices that matter to the rest of zbuf:

- Rotary tables are computed in ``forward`` from the sequence length, not stored as buffers, so a
  model built on the meta device needs nothing but its parameters materialised, and every engine
  (DDP, FSDP2, ``zbuf.shard``) sees the same parameter-only module.
- A tied output head reuses ``embed_tokens.weight`` through ``F.linear``: there is one parameter,
  one state-dict key and nothing for a wrapper to de-duplicate.
- Activation checkpointing lives inside ``Block.forward`` (non-reentrant
  ``torch.utils.checkpoint``), so a per-block ``torch.compile`` captures it and the state-dict keys
  do not change (no wrapper module). ``"full"`` recomputes the whole block in backward;
  ``"selective"`` applies torchtitan's op-level policy ([Note: selective checkpointing]). Under
  zbuf's ``recompute="auto"`` every checkpointed block is a candidate region: the compiler
  decides how much of it to keep.
- Every module's ``reset_parameters()`` produces the intended initialisation, so materialising a
  meta model module by module (``to_empty`` then ``reset_parameters``) equals building it eagerly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .linear_cross_entropy import linear_cross_entropy
from .presets import PRESETS, ModelConfig, resolve_config

__all__ = [
    "ModelConfig",
    "PRESETS",
    "RMSNorm",
    "Attention",
    "MLP",
    "Block",
    "Decoder",
    "build_model",
    "resolve_config",
    "apply_activation_checkpointing",
    "AC_MODES",
    "selective_checkpoint_context",
    "loss",
    "cross_entropy",
    "count_params",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back (as Qwen3 does under bf16)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _Linear(nn.Linear):
    """``nn.Linear`` without bias, initialised N(0, std) instead of Kaiming-uniform."""

    def __init__(self, in_features: int, out_features: int, std: float, *, device=None,
                 dtype=None) -> None:
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class _Embedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, std): N(0, 1) would give a tied head huge logits."""

    def __init__(self, num: int, dim: int, std: float, *, device=None, dtype=None) -> None:
        self.std = std
        super().__init__(num, dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim), half-split layout (Hugging Face ``rotate_half``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.float32) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm and rotary embedding."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.init_std, **kw)
        self.k_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.init_std, **kw)
        self.v_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.init_std, **kw)
        self.o_proj = _Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.init_std, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, **kw)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            # Expand K/V to the query heads. SDPA's enable_gqa would avoid the copy, but not every
            # fused kernel accepts it; an expand+reshape takes the flash/cuDNN paths everywhere.
            k = k[:, :, None].expand(b, self.num_kv_heads, groups, t, self.head_dim).reshape(
                b, self.num_heads, t, self.head_dim)
            v = v[:, :, None].expand(b, self.num_kv_heads, groups, t, self.head_dim).reshape(
                b, self.num_heads, t, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.gate_proj = _Linear(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std, **kw)
        self.up_proj = _Linear(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std, **kw)
        self.down_proj = _Linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg.init_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


AC_MODES = ("full", "selective")
"""How a checkpointed block is recomputed in backward (``apply_activation_checkpointing``)."""

_aten = torch.ops.aten
_SAC_SAVED_OPS = frozenset(
    op for op in (
        _aten.mm.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        # The CPU kernel too, so that CPU runs and tests exercise the same policy.
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        _aten.max.default,
    ))


def selective_checkpoint_context():
    """The ``context_fn`` of torchtitan's op-level selective activation checkpointing.

    [Note: selective checkpointing]
    What FSDP2 users run as "selective AC" (torchtitan/distributed/activation_checkpoint.py,
    ``selective_ac_option="op"``): in every checkpointed block the outputs of matmuls, attention
    kernels, reduce-scatters and ``max`` are saved, except every second matmul, and everything
    else is recomputed. The matmuls are counted per forward (and per recomputation) of the block,
    so in a Qwen3 block q, v, gate and down are kept and k, o and up recomputed. A fresh counter
    per call: ``checkpoint`` calls ``context_fn`` once per region.
    """
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func is _aten.mm.default:
            counts[key] += 1
        save = func in _SAC_SAVED_OPS and not (func is _aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Block(nn.Module):
    """Pre-norm transformer block; optionally checkpointed (recomputed in backward)."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
        self.self_attn = Attention(cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
        self.mlp = MLP(cfg, **kw)
        self.activation_checkpointing: Union[bool, str] = False
        """False, or a mode of ``AC_MODES`` (read while tracing: set it before compiling)."""

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            selective = self.activation_checkpointing == "selective"
            return checkpoint(self._body, x, cos, sin, use_reentrant=False,
                              **({"context_fn": selective_checkpoint_context} if selective else {}))
        return self._body(x, cos, sin)


class Decoder(nn.Module):
    """Qwen3-shaped causal language model: ``forward(tokens [B, T] int64) -> logits [B, T, V]``,
    or with ``targets`` [B, T] the mean fp32 next-token loss, computed without the logits
    ([Note: the logits are never whole] in zbuf/linear_cross_entropy.py).

    Logits come out in the compute dtype; ``loss`` upcasts them to fp32.
    """

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.config = cfg
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, **kw)
        self.layers = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
        self.lm_head: Optional[_Linear] = (
            None if cfg.tie_embeddings
            else _Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std, **kw))

    def reset_parameters(self) -> None:
        """Re-initialise every parameter in place (after ``to_empty`` on a meta model).

        Seed the generator first for a reproducible model: the modules are visited in
        registration order, so the same seed gives the same weights as an eager build.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"Decoder expects tokens of shape [batch, seq], got "
                             f"{tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len "
                             f"{self.config.max_seq_len}")
        h = self.embed_tokens(tokens)
        cos, sin = rotary_tables(t, self.config.head_dim, self.config.rope_theta, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if targets is not None:
            return linear_cross_entropy(h, weight, targets, ignore_index)
        return F.linear(h, weight)


def build_model(preset_or_config: Union[str, ModelConfig], *, device=None,
                dtype: Optional[torch.dtype] = None) -> Decoder:
    """Build the decoder for a preset name (see ``PRESETS``) or a ``ModelConfig``.

    ``device="meta"`` allocates nothing (count parameters, or materialise later with
    ``model.to_empty(device=...)`` and ``model.reset_parameters()``). The caller seeds the RNG.
    """
    cfg = resolve_config(preset_or_config)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"build_model dtype must be a floating-point dtype, got {dtype}")
    return Decoder(cfg, device=device, dtype=dtype)


def apply_activation_checkpointing(model: Decoder, mode: Union[bool, str] = True) -> Decoder:
    """Checkpoint every block (non-reentrant): keep only block inputs and recompute the block in
    backward (``True`` or ``"full"``), or keep what torchtitan's op-level policy keeps
    (``"selective"``, [Note: selective checkpointing]); ``False`` turns it off.

    Call before ``torch.compile`` (the mode is read while tracing). Returns the model.
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"apply_activation_checkpointing expects a zbuf.models.Decoder, got "
                        f"{type(model).__name__}")
    if mode is True:
        mode = "full"
    if mode is not False and mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: use True, False or one of "
                         f"{', '.join(AC_MODES)}")
    for layer in model.layers:
        layer.activation_checkpointing = mode
    return model


CROSS_ENTROPY_CHUNK_BYTES = 1 << 30
"""fp32 bytes of logits that ``cross_entropy`` works on at once ([Note: lean cross-entropy])."""


class _CrossEntropy(torch.autograd.Function):
    """[Note: lean cross-entropy]
    ``F.cross_entropy(logits.float(), ...)`` materialises the fp32 logits, their fp32 log-softmax
    (saved for backward) and an fp32 gradient: three [tokens, vocab] fp32 tensors, 9.3 GiB each
    for qwen3-8b at 16,384 tokens per rank, against 4.6 GiB for the bf16 logits themselves.
    Compiled inside zbuf's graph they are activations the memory plan must make room for, room
    that budgeted recompute would rather spend on keeping blocks: for two qwen3-8b layers
    (micro-batch 4, seq 4096, 2 ranks, fake tensors) the step's projected activation peak was
    19.0 GiB with that loss in the graph (forward; 6.0 with it outside) and is 12.0 GiB with this
    one (backward; forward 7.0). Here the fp32 work is done in row chunks of
    ``CROSS_ENTROPY_CHUNK_BYTES``: forward keeps only the bf16 logits and an fp32 log-sum-exp per
    row; backward rebuilds each chunk's softmax from them and writes the gradient in the logits'
    dtype. Same value and gradient as the fp32 formula, to fp32 rounding.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, rows: int):
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in logits.split(rows)])
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.rows = rows
        return torch.where(valid, lse - picked, torch.zeros_like(lse)).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, safe, valid, lse, count = ctx.saved_tensors
        rows = ctx.rows
        scale = torch.where(valid, grad / count, torch.zeros_like(lse))
        chunks = []
        for c, l, t, w in zip(logits.split(rows), lse.split(rows), safe.split(rows),
                              scale.split(rows)):
            p = torch.exp(c.float() - l[:, None])
            p = p.scatter_add(1, t[:, None], torch.full_like(l[:, None], -1.0))
            chunks.append((p * w[:, None]).to(c.dtype))
        return torch.cat(chunks), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [..., vocab] against ``targets`` [...], computed in fp32
    without materialising fp32 logits ([Note: lean cross-entropy]); ``targets`` equal to
    ``ignore_index`` count not (all ignored: NaN, as ``F.cross_entropy``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = max(1, CROSS_ENTROPY_CHUNK_BYTES // (4 * logits.shape[-1]))
    return _CrossEntropy.apply(flat, targets.reshape(-1), ignore_index, rows)


def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
         ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; ``targets`` equal to ``ignore_index`` count not."""
    return cross_entropy(model(tokens), targets, ignore_index)


def count_params(model: nn.Module) -> int:
    """Unique parameter elements (meta tensors count too)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

