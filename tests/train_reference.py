"""The unsharded reference of ``zbuf train`` / ``zbuf bench`` runs on CPU: single-process fp32
training of the same initial model on the same global batches, with the run's optimizer. Every
engine must reproduce its losses to float rounding."""

from __future__ import annotations


def reference_losses(cfg, steps: int, micro_batch: int, seq_len: int, world: int) -> list[float]:
    """Losses of ``steps`` steps of ``cfg`` (a resolved ``TrainConfig``: model, seed, task,
    optimizer, lr) on global batches of ``micro_batch * world`` sequences of ``seq_len``."""
    import torch

    from zbuf.models import loss
    from zbuf.train.data import global_batch
    from zbuf.train.engines import build_base_model, build_optimizer

    model = build_base_model(cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    out = []
    for step in range(steps):
        tokens, targets = global_batch(cfg.task, cfg.seed, step, micro_batch * world, seq_len,
                                       model.config.vocab_size)
        value = loss(model, tokens, targets)
        opt.zero_grad()
        value.backward()
        opt.step()
        out.append(value.item())
    return out
