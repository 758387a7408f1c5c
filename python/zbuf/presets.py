"""Model shapes: ``ModelConfig`` and the built-in ``PRESETS`` (plain data, no torch).

Kept apart from ``zbuf.models`` (the modules themselves) so that what only needs a shape (the
``zbuf`` command's option parsing and validation, the record) never imports torch.
``zbuf.models`` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

__all__ = ["ModelConfig", "PRESETS", "resolve_config"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-style decoder. Validated on construction."""

    vocab_size: int
    """Number of token ids; the embedding has this many rows."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads per attention layer."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: int
    """Width of one attention head (Qwen3 decouples it from ``hidden_size // num_heads``); even,
    because rotary embedding rotates pairs of channels."""
    ffn_hidden_size: int
    """Inner width of the SwiGLU MLP (``intermediate_size`` in Hugging Face configs)."""
    tie_embeddings: bool = False
    """Use the embedding matrix as the output projection (no separate ``lm_head``)."""
    rope_theta: float = 1_000_000.0
    """Rotary embedding base frequency."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    max_seq_len: int = 40_960
    """Longest sequence the model accepts (Qwen3's ``max_position_embeddings``)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of embeddings and linear weights."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "ffn_hidden_size", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embedding, got "
                             f"{self.head_dim}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got "
                             f"{self.tie_embeddings!r}")

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Exact parameter count of the model this config builds."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q/k/v/o + q_norm + k_norm
        mlp = 3 * h * self.ffn_hidden_size
        block = attn + mlp + 2 * h  # two pre-norms
        embed = self.vocab_size * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return embed + self.num_layers * block + h + head

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (forward + backward), the MFU numerator.

        ``6 * N`` for the matmuls, where N excludes the embedding lookup but includes the output
        projection, plus ``12 * layers * heads * head_dim * seq_len`` for attention scores and
        values (the PaLM / torchtitan convention: the causal mask and activation-checkpointing
        recompute are not counted).
        """
        dense = self.num_params() - self.vocab_size * self.hidden_size
        if self.tie_embeddings:
            dense += self.vocab_size * self.hidden_size  # the head still multiplies
        attn = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * dense + attn


def _qwen3(hidden: int, layers: int, heads: int, ffn: int, tie: bool) -> ModelConfig:
    # Shared by every public Qwen3 dense config: head_dim 128, 8 KV heads, vocab 151936,
    # rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960.
    return ModelConfig(vocab_size=151_936, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=8, head_dim=128, ffn_hidden_size=ffn,
                       tie_embeddings=tie)


PRESETS: dict[str, ModelConfig] = {
    # CPU-friendly (2.4 M parameters): tied, so tests exercise the tied head; GQA 4:2; a byte
    # vocabulary, so the synthetic tasks need no tokenizer.
    "tiny": ModelConfig(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=64, ffn_hidden_size=512, tie_embeddings=True,
                        rope_theta=10_000.0, max_seq_len=2048),
    # Hugging Face Qwen/Qwen3-*/config.json (hidden, layers, heads, intermediate, tied).
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tie=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tie=False),
    # 32.8 B parameters: as rank 0 of 8, fp32 shards 16.4 GB, gradients 16.4 GB, AdamW's
    # moments 32.8 GB, so an 80 GiB card trains it only with the moments off the device
    # ([Note: optimizer state offloaded after backward] in zbuf/optimizer_step_offload.py).
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tie=False),
}


def resolve_config(preset_or_config: Union[str, ModelConfig]) -> ModelConfig:
    """A ``ModelConfig`` from a preset name or a config (returned as is)."""
    if isinstance(preset_or_config, ModelConfig):
        return preset_or_config
    if isinstance(preset_or_config, str):
        try:
            return PRESETS[preset_or_config]
        except KeyError:
            raise ValueError(f"unknown model preset {preset_or_config!r}; choose one of "
                             f"{', '.join(PRESETS)} or pass a ModelConfig") from None
    raise TypeError(f"expected a preset name or a ModelConfig, got "
                    f"{type(preset_or_config).__name__}")
