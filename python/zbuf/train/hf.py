"""``--model hf:<type>``: which Hugging Face model types zbuf trains, checked before any worker.

A type is supported when ``engines.HFDecoder`` can wrap it with the preset's exact shape (its
config takes ``head_dim`` and ``num_key_value_heads``, its blocks are ``model.layers``) and a test
trains it through ``zbuf.shard`` against an unsharded reference (``tests/test_shard_hf.py``,
``tests/test_cli_train.py``). transformers itself is the optional extra ``hf`` (zbuf is not on
the package index: from a checkout, ``pip install '.[hf]'``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .errors import ConfigError

__all__ = ["HF_MODEL_TYPES", "HF_INSTALL", "check_hf_model", "checkpoint_layers"]

HF_MODEL_TYPES = ("llama", "qwen3")
"""The ``transformers`` model types ``--model hf:<type>`` accepts."""

HF_INSTALL = "pip install transformers (from a zbuf checkout: pip install '.[hf]')"
"""How a user gets transformers for ``--model hf:...``."""


def _supported() -> str:
    return " and ".join(f"hf:{t}" for t in HF_MODEL_TYPES)


def _transformers_knows(model_type: str) -> bool:
    # The name table only, not the models: cheap, and no torch import.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def check_hf_model(model_type: str) -> None:
    """``ConfigError`` naming the problem and the fix unless ``hf:<model_type>`` can be built
    here: a supported type, and transformers installed."""
    installed = importlib.util.find_spec("transformers") is not None
    if model_type not in HF_MODEL_TYPES:
        if installed and _transformers_knows(model_type):
            why = f"transformers has model type {model_type!r}, but zbuf does not support it"
        else:
            why = f"no transformers model type is called {model_type!r}"
        raise ConfigError(f"--model hf:{model_type}: {why}; zbuf supports {_supported()} (or "
                          f"a built-in --preset)")
    if not installed:
        raise ConfigError(f"--model hf:{model_type} needs the transformers package: "
                          f"{HF_INSTALL}")


def checkpoint_layers(model: Any, checkpoint_kwargs: dict) -> None:
    """Checkpoint every decoder layer of Hugging Face ``model`` with ``checkpoint_kwargs`` for
    ``torch.utils.checkpoint.checkpoint``: ``activation_checkpointing_enable`` where transformers
    has it (5.25 on), the ``gradient_checkpointing_enable`` it deprecates before that."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
