"""One rank's training run of one engine: build, step, measure, gather the per-rank numbers.

[Note: step timing]
A step is forward + loss, backward and the optimizer step, timed on the host after a device
synchronize, so every step's time includes all the device work it launched. The synchronize
costs one host round-trip per step for every engine alike. Step ``s`` of the record is the
slowest rank's time (the step cannot finish before its last rank); loss is the mean over ranks,
the one definition the live progress, the record and the summary share: one all-reduce of the
loss per step, after the step's clock stopped. Every other cross-rank reduction happens once,
after the last step, so measuring adds no collective to the time being measured.

[Note: resumed runs]
With ``--resume`` the run starts at the step of the latest checkpoint (``SaveResumePolicy``),
loaded after the engine is built and before the clock starts. Its rows cover steps
``start..steps-1`` only; the record says where it resumed (``start_step``). Warm-up counts from
the first step this process runs (that is the step that compiles), shortened so that at least one
step is measured. Checkpoint saves run after a step's clock stopped, so step times never include
them; their durations go to the record's ``checkpoints`` list.
"""

from __future__ import annotations

import gc
import time
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import faults
from .config import Engine, TrainConfig
from .data import rank_batch
from .engines import build_engine
from .metrics import MemoryProbe, MemorySample
from .profile import PROFILED_STEPS, StepProfiler
from .record import budget_notices

__all__ = ["run_engine", "StepRow"]


class StepRow(NamedTuple):
    """One rank's numbers of one step."""

    time_s: float
    """Host time of the step ([Note: step timing])."""
    loss: float
    memory: MemorySample
    """Memory after the step."""


def _cap_memory(cfg: TrainConfig, device: torch.device, pool) -> Optional[dict[str, Any]]:
    """Apply ``--mem-frac``; for zbuf engines the pool's bytes come out of the same cap.

    [Note: fair memory cap] ``set_per_process_memory_fraction`` limits only the caching
    allocator, and the zbuf pool allocates beside it. So that zbuf does not get more memory than
    the engines it is compared with, its allocator fraction is lowered by the pool's budget once
    the schedule has sized the pool (after the first step): allocator + pool <= mem_frac of the
    card, the same total every engine gets.
    """
    if cfg.mem_frac is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    frac = cfg.mem_frac
    pool_bytes = 0
    if pool is not None:
        stats = pool.stats()
        pool_bytes = max(getattr(stats, "budget_bytes", 0) or 0,
                         getattr(stats, "high_water_bytes", 0) or 0)
        frac = max(0.01, cfg.mem_frac - pool_bytes / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return {"mem_frac": cfg.mem_frac, "allocator_fraction": frac, "pool_bytes": pool_bytes,
            "device_total_bytes": total}


def run_engine(engine: Engine, cfg: TrainConfig, device: torch.device, progress) -> dict:
    """Train ``cfg.steps`` steps with ``engine``; every rank returns the same result dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    # Capped before the engine is built, so the zbuf engines' rank-agreed budget sees the cap.
    memory_cap = _cap_memory(cfg, device, None)
    t0 = time.perf_counter()
    with record_function(f"zbuf.train.setup[{engine.value}]"):
        setup = build_engine(engine, cfg, device)
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the full model the shards were cut from
    setup_seconds = time.perf_counter() - t0
    policy = cfg.save_resume_policy()
    t0 = time.perf_counter()
    with record_function("zbuf.train.resume"):
        start = policy.resume_step(setup.model, setup.optimizer)
    resume_seconds = time.perf_counter() - t0
    if start >= cfg.steps:  # the launcher checks this before starting workers; a race is left
        raise RuntimeError(f"the checkpoint under {cfg.checkpoint_dir} is at step {start}, at or "
                           f"past --steps {cfg.steps}: nothing to train")
    probe = MemoryProbe(device, setup.pool)
    probe.reset()
    dist.barrier()

    mcfg_vocab = _vocab(setup.model)
    rows: list[StepRow] = []
    saves: list[dict[str, Any]] = []
    notices: list[str] = []
    progress.start_engine(engine.value, cfg.steps, start)
    for step in range(start, cfg.steps):
        batch = rank_batch(cfg.task, cfg.seed, step, cfg.micro_batch, world, rank, cfg.seq_len,
                           mcfg_vocab, device)
        t_step = time.perf_counter()
        loss = _train_step(setup, batch)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t_step
        value = _mean_over_ranks(loss, world)  # off the clock ([Note: step timing])
        probe.feed_pool()
        if step == start and setup.pool is not None and cfg.mem_frac is not None:
            memory_cap = _cap_memory(cfg, device, setup.pool)
        if step == start:  # the first step planned the schedule: say what it changed
            notices = budget_notices(cfg.budget, setup.schedule_report())
            for text in notices:
                progress.notice(text)
        m = probe.sample()
        rows.append(StepRow(elapsed, value, m))
        progress.step(step, value, cfg.micro_batch * cfg.seq_len / elapsed, m.device_bytes)
        faults.fault_point("train.step_done")  # [Note: fault points]
        t0 = time.perf_counter()
        with record_function("zbuf.train.checkpoint"):
            path = policy.after_step(step + 1, setup.model, setup.optimizer)
        if path is not None:
            saves.append({"step": step + 1, "path": str(path),
                          "seconds": time.perf_counter() - t0})
    progress.end_engine()
    if cfg.profile_dir is not None:
        with record_function("zbuf.train.profile"), StepProfiler(cfg.profile_dir, engine.value, rank):
            for step in range(cfg.steps, cfg.steps + PROFILED_STEPS):  # [Note: profiled steps]
                loss = _train_step(setup, rank_batch(cfg.task, cfg.seed, step, cfg.micro_batch,
                                                     world, rank, cfg.seq_len, mcfg_vocab, device))
            if cuda:
                torch.cuda.synchronize(device)

    schedule = setup.schedule_report()
    pool_stats = probe.pool_stats()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)
    result = _combine(engine, cfg, everyone, world, start)
    result.update(setup_seconds=setup_seconds, pool=pool_stats, schedule=schedule, notices=notices,
                  memory_cap=memory_cap, resume_seconds=resume_seconds, checkpoints=saves)
    del setup, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _train_step(setup, batch) -> torch.Tensor:
    """Forward + loss, backward, optimizer step; returns the loss (not synchronized)."""
    with record_function("zbuf.train.step"):
        with record_function("zbuf.train.forward"):
            loss = setup.step_loss(batch)
        with record_function("zbuf.train.backward"):
            loss.backward()
        with record_function("zbuf.train.optimizer"):
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
    return loss


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / world


def _vocab(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return cfg.vocab_size
    return model.hf.config.vocab_size


def _combine(engine: Engine, cfg: TrainConfig, per_rank: list[list[StepRow]],
             world: int, start: int = 0) -> dict:
    """Rows of steps ``start..cfg.steps-1`` from every rank -> the engine's record entry."""
    n = cfg.steps - start
    warmup = min(cfg.warmup, n - 1)  # [Note: resumed runs]
    measured = slice(warmup, n)
    steps = []
    for i in range(n):
        col = [r[i] for r in per_rank]
        steps.append({
            "step": start + i,
            "loss": col[0].loss,  # already the mean over ranks, the same on every rank
            "time_s": max(c.time_s for c in col),
            "tokens": cfg.micro_batch * cfg.seq_len * world,
            "device_bytes": int(max(c.memory.device_bytes for c in col)),
            "peak_device_bytes": int(max(c.memory.peak_device_bytes for c in col)),
            "pool_bytes": int(max(c.memory.pool_bytes for c in col)),
            "alloc_retries": [int(c.memory.alloc_retries) for c in col],
        })
    ranks = []
    for r, rows in enumerate(per_rank):
        last = rows[-1]
        before = rows[warmup - 1].memory.alloc_retries if warmup > 0 else 0
        ranks.append({
            "rank": r,
            "peak_device_bytes": int(max(row.memory.peak_device_bytes for row in rows)),
            "allocated_peak_bytes": int(max(row.memory.allocated_peak_bytes for row in rows)),
            "pool_high_water_bytes": int(max(row.memory.pool_high_water_bytes for row in rows)),
            "alloc_retries_total": int(last.memory.alloc_retries),
            "alloc_retries_measured": int(last.memory.alloc_retries - before),
            "measured_steps": len(rows[measured]),
        })
    return {"engine": engine.value, "status": "ok", "start_step": start,
            "warmup_steps": warmup, "steps": steps, "per_rank": ranks}
