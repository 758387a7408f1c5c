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
With ``--resume`` the run starts at the step of the latest checkpoint (``SaveResumePolicy``; or
the one ``--resume-from`` names),
loaded after the engine is built and before the clock starts. Its rows cover steps
``start..steps-1`` only; the record says where it resumed (``start_step``). Warm-up counts from
the first step this process runs (that is the step that compiles), shortened so that at least one
step is measured. Checkpoint saves run after a step's clock stopped, so step times never include
them; their durations go to the record's ``checkpoints`` list.

[Note: interrupted runs]
Ctrl-C (``KeyboardInterrupt``) or SIGTERM (``SystemExit``) during the steps keeps what finished:
``run_engine`` hands ``on_stop`` a result of status ``"interrupted"`` holding the rows of
the steps this rank finished, with the pool, the plans in force and the step-memory decisions
made so far, then lets the interruption go on. Its peers are being stopped at the same moment,
so no collective gathers their rows: every rank hands its own, and the launcher joins them
(``zbuf.train.interrupted``; under torchrun, where no process sees the others' files, the
record holds rank 0's times and memory, ``per_rank`` one entry). The loss of each finished step
is already the mean over ranks.
A Ctrl-C reaches every rank at once, and a peer that stops first fails this rank's collective
before its own ``KeyboardInterrupt`` arrives (which may then land while the result is written):
a peer failure is handled alike, and the write is retried once if the rank's own interrupt cuts
it short. Seen without this: 2 of 4 ``test_interrupt_leaves_no_orphans_and_a_record[ctrl-c]``
runs recorded no step. If this rank's own interrupt never arrived as an exception (a finaliser
swallowed it), the peer failure is still that interrupt: [Note: a stop a peer's failure
overtook] in faults.py.

A step that fails on this rank (an out-of-memory error, above all) is kept the same way, with
status ``"failed"`` and ``failed_at``: the step and phase it failed in, the step-memory
decisions made so far and the plans in force (their projected peaks). Without it the record of
a run that ran out of memory (qwen3-14b's ``zbuf:auto`` as rank 0 of 8 on one H200) says only
"CUDA out of memory", and not whether step 0's plan or the grown one ran out.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import faults
from ..memory import PhaseMeter, StepMemoryRow, StepPhases
from .compile_phases import PhaseClock
from .config import Engine, TrainConfig
from .data import rank_batch
from .engines import build_engine
from .metrics import MemoryProbe, MemorySample
from .profile import PROFILED_STEPS, StepProfiler
from .record import budget_notices
from .simulate import CommEstimate, collective_bytes, step_communication

__all__ = ["run_engine", "StepRow"]


class StepRow(NamedTuple):
    """One rank's numbers of one step."""

    time_s: float
    """Host time of the step ([Note: step timing])."""
    loss: float
    memory: MemorySample
    """Memory after the step."""
    phases: StepPhases
    """Torch's peak in each phase of the step ([Note: phase peaks] in zbuf/memory/phases.py)."""
    step_memory: Optional[StepMemoryRow]
    """The zbuf engines' pool and budget in the step ([Note: whole-step budget] in
    zbuf/memory/step.py); None for the other engines."""


def _cap_memory(cfg: TrainConfig, device: torch.device, step_memory) -> Optional[dict[str, Any]]:
    """Apply ``--mem-frac``: torch's allocator gets that fraction of the card.

    [Note: fair memory cap]
    ``set_per_process_memory_fraction`` limits only the caching allocator, and the zbuf pool
    allocates beside it. So that zbuf does not get more memory than the engines it is compared
    with, the zbuf engines hand the cap to their ``SharedMemory``, which keeps allocator + pool
    <= mem_frac of the card at every moment, the same total every engine gets ([Note: emulated
    capacity] in zbuf/memory/shared.py). Applied before the engine is built (so that the rank-agreed
    budget sees it) and again, through the pool's arbiter, after.
    """
    if cfg.mem_frac is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if step_memory is not None:
        step_memory.memory.emulate_capacity(int(cfg.mem_frac * total))
        return None
    torch.cuda.set_per_process_memory_fraction(cfg.mem_frac, device)
    return {"mem_frac": cfg.mem_frac, "allocator_fraction": cfg.mem_frac, "pool_share_bytes": 0,
            "device_total_bytes": total}


def run_engine(engine: Engine, cfg: TrainConfig, device: torch.device, progress,
               label: Optional[str] = None,
               on_stop: Optional[Callable[[dict], None]] = None) -> dict:
    """Train ``cfg.steps`` steps with ``engine``; every rank returns the same result dict.
    ``label`` names the run in the record, the progress bar and profile files (default: the
    engine's name; ``TrainConfig.run_labels``). ``on_stop``: called with this rank's result of
    the steps done ([Note: interrupted runs]) when Ctrl-C, SIGTERM or an error stops the steps;
    the interruption or error then goes on."""
    label = label or engine.value
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
    t0 = time.perf_counter()
    with record_function("zbuf.train.resume"):
        checkpoints = cfg.save_resume_policy().begin(setup.model, setup.optimizer)
    start = checkpoints.start_step
    resume_seconds = time.perf_counter() - t0
    if start >= cfg.steps:  # the launcher checks this before starting workers; a race is left
        raise RuntimeError(f"the checkpoint under {cfg.checkpoint_dir} is at step {start}, at or "
                           f"past --steps {cfg.steps}: nothing to train")
    step_memory = setup.step_memory
    if step_memory is not None:
        _cap_memory(cfg, device, step_memory)
    # zbuf engines measure phases with hooks of their own; the loop marks them for the others.
    meter = step_memory.meter if step_memory is not None else \
        PhaseMeter(device, setup.model, setup.optimizer)
    marks = None if step_memory is not None else meter.mark
    probe = MemoryProbe(device, setup.pool)
    probe.reset()
    dist.barrier()

    mcfg_vocab = _vocab(setup.model)
    rows: list[StepRow] = []
    saves: list[dict[str, Any]] = []
    notices: list[str] = []
    # The first step's phases, and those of a later step that compiled (a re-plan, a new shape).
    compile_phases: list[dict[str, Any]] = []
    progress.start_engine(label, cfg.steps, start)
    counted = None  # zbuf's collective bytes in the latest step (simulated runs' estimate)
    try:
        for step in range(start, cfg.steps):
            before = collective_bytes(setup.model)
            batch = rank_batch(cfg.task, cfg.seed, step, cfg.micro_batch, world, rank, cfg.seq_len,
                               mcfg_vocab, device)
            t_step = time.perf_counter()
            with PhaseClock() as clock:  # [Note: compile phases]
                loss = _train_step(setup, batch, marks)
                if cuda:
                    torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t_step
            counted = tuple(a - b for a, b in zip(collective_bytes(setup.model), before))
            timed = clock.result(elapsed)
            if step == start or timed.caches["graphs"] > 0:
                compile_phases.append(dict(timed.to_json(), step=step))
            value = _mean_over_ranks(loss, cfg.processes)  # off the clock ([Note: step timing])
            if step_memory is not None:
                mem = step_memory.close_step()
                phases = mem.phases
            else:
                probe.feed_pool()
                mem, phases = None, meter.close_step()
            if step == start:  # the first step planned the schedule: say what it changed
                notices.extend(budget_notices(cfg.gather_budget, setup.schedule_report()))
                for text in notices:
                    progress.notice(text)
            m = probe.sample(phases)
            rows.append(StepRow(elapsed, value, m, phases, mem))
            progress.step(step, value, cfg.micro_batch * cfg.seq_len / elapsed, m.device_bytes)
            faults.fault_point("train.step_done")  # [Note: fault points]
            faults.raise_swallowed_stop()  # [Note: a stop a finaliser swallowed] in faults.py
            t0 = time.perf_counter()
            with record_function("zbuf.train.checkpoint"):
                path = checkpoints.after_step(step + 1, setup.model, setup.optimizer)
            if path is not None:
                saves.append({"step": step + 1, "path": str(path),
                              "seconds": time.perf_counter() - t0})
    except BaseException as e:
        def stopped() -> None:
            interrupt = isinstance(e, (KeyboardInterrupt, SystemExit)) or faults.is_peer_failure(e)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                # Delivered. A stop noted beside a peer's failure stays noted: it is what ended
                # the steps ([Note: a stop a peer's failure overtook] in faults.py).
                faults.stop_delivered()
            progress.end_engine()
            if on_stop is None:
                return
            result = _combine(engine, cfg, [rows], world, start)
            result.update(label=label, ac=cfg.ac, status="interrupted" if interrupt else "failed",
                          setup_seconds=setup_seconds, resume_seconds=resume_seconds,
                          checkpoints=[s for s in saves if os.path.isdir(s["path"])],
                          run_id=checkpoints.run_id, notices=notices,
                          compile_phases=compile_phases,
                          resumed_from=str(checkpoints.resumed_from)
                          if checkpoints.resumed_from else None)
            if not interrupt:
                first_line = str(e).splitlines()[0] if str(e) else ""
                result["failed_at"] = {"step": step, "phase": meter.phase,
                                       "error": f"{type(e).__name__}: {first_line}"}
            try:  # best effort: what the stopped step leaves must not hide why it stopped
                result.update(pool=probe.pool_stats(), schedule=setup.schedule_report(),
                              step_memory=(step_memory.report() if step_memory is not None
                                           else None))
            except Exception as extra:  # noqa: BLE001
                result.get("failed_at", result)["unreported"] = f"{type(extra).__name__}: {extra}"
            on_stop(result)

        try:
            stopped()
        except (KeyboardInterrupt, SystemExit):
            # This rank's own stop, landing while it handles a peer's failure (or the launcher's
            # SIGTERM after a Ctrl-C): once more, then ``e`` goes on.
            stopped()
        raise
    progress.end_engine()
    if cfg.profile_dir is not None:
        with record_function("zbuf.train.profile"), StepProfiler(cfg.profile_dir, label.replace(":", "-"), rank):
            for step in range(cfg.steps, cfg.steps + PROFILED_STEPS):  # [Note: profiled steps]
                loss = _train_step(setup, rank_batch(cfg.task, cfg.seed, step, cfg.micro_batch,
                                                     world, rank, cfg.seq_len, mcfg_vocab, device))
            if cuda:
                torch.cuda.synchronize(device)

    schedule = setup.schedule_report()
    pool_stats = probe.pool_stats()
    if step_memory is not None:
        memory_cap = step_memory.memory.capacity_fraction()
        if memory_cap is not None:
            memory_cap["mem_frac"] = cfg.mem_frac
    everyone = _from_every_rank(rows, cfg, world)
    result = _combine(engine, cfg, everyone, world, start)
    # Retention may have deleted this run's older saves (rank 0 prunes before the collective
    # above returns): the record lists the checkpoints that exist.
    saves = [s for s in saves if os.path.isdir(s["path"])]
    phases_per_rank = _from_every_rank(compile_phases, cfg, world)
    result.update(label=label, ac=cfg.ac, setup_seconds=setup_seconds, pool=pool_stats, schedule=schedule, notices=notices,
                  compile_phases=[p[0] for p in phases_per_rank],
                  recompile_phases=[p[1:] for p in phases_per_rank],
                  memory_cap=memory_cap, resume_seconds=resume_seconds, checkpoints=saves,
                  run_id=checkpoints.run_id,
                  resumed_from=str(checkpoints.resumed_from) if checkpoints.resumed_from else None,
                  step_memory=step_memory.report() if step_memory is not None else None)
    if cfg.simulated:  # [Note: simulated ranks]: what the collectives would move, beside
        result["communication"] = _communication(engine, cfg, setup, world, counted).to_json()
    if step_memory is not None:
        step_memory.detach()
    del setup, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _train_step(setup, batch, marks=None) -> torch.Tensor:
    """Forward + loss, backward, optimizer step; returns the loss (not synchronized).
    ``marks``: the phase meter's ``mark`` when the engine's modules carry no phase hooks."""
    mark = marks or (lambda _phase: None)
    with record_function("zbuf.train.step"):
        with record_function("zbuf.train.forward"):
            mark("forward")
            loss = setup.step_loss(batch)
        with record_function("zbuf.train.backward"):
            mark("backward")
            faults.fault_point("train.backward")  # [Note: fault points]
            loss.backward()
        with record_function("zbuf.train.optimizer"):
            mark("optimizer")
            setup.optimizer.step()
            mark("after")
            setup.optimizer.zero_grad(set_to_none=True)
    return loss


def _communication(engine: Engine, cfg: TrainConfig, setup, world: int,
                   counted: Optional[tuple[int, int]]) -> CommEstimate:
    """One rank's per-step communication estimate: zbuf's counted bytes of the last step, or
    the FSDP2 / DDP engine's bytes derived from the model."""
    gathered = torch.bfloat16 if cfg.dtype == "bf16" and engine is Engine.FSDP2 else None
    return step_communication(engine.value, world, cfg.link_gbps, setup.model,
                              counted if engine.uses_zbuf else None, gathered)


def _mean_over_ranks(loss: torch.Tensor, ranks: int) -> float:
    """The mean over the ``ranks`` real ranks (simulated: rank 0's own, its all-reduce adds
    nothing)."""
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / ranks


def _from_every_rank(obj: Any, cfg: TrainConfig, world: int) -> list[Any]:
    """``obj`` of every real rank, by rank: all ``world`` of them, or under simulated ranks
    only this one's (the fake group's gather returns nothing; [Note: simulated ranks])."""
    if cfg.simulated:
        return [obj]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


def _vocab(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return cfg.vocab_size
    return model.hf.config.vocab_size


def _pool_field(name: str):
    return lambda r: getattr(r.step_memory, name) if r.step_memory is not None else 0


_PER_RANK: dict[str, Any] = {
    "alloc_retries": lambda r: int(r.memory.alloc_retries),
    "forward_peak_bytes": lambda r: r.phases.forward_peak_bytes,
    "backward_peak_bytes": lambda r: r.phases.backward_peak_bytes,
    "optimizer_peak_bytes": lambda r: r.phases.optimizer_peak_bytes,
    "reserved_peak_bytes": lambda r: r.phases.reserved_peak_bytes,
    "pool_held_bytes": _pool_field("pool_held_bytes"),
    "pool_idle_bytes": _pool_field("pool_idle_bytes"),
    "pool_yielded_bytes": _pool_field("yielded_bytes"),
    "pool_reclaims": _pool_field("reclaims"),
    "torch_ooms": _pool_field("torch_ooms"),
    "budget_bytes": lambda r: r.step_memory.budget_bytes if r.step_memory is not None else None,
    "replanned": lambda r: bool(r.step_memory is not None and r.step_memory.replanned),
    "pool_budget_bytes": _pool_field("pool_budget_bytes"),
    "pool_recovered": lambda r: bool(r.step_memory is not None and r.step_memory.pool_recovered),
    "pool_alloc_failures": _pool_field("pool_alloc_failures"),
}
"""Step fields the record keeps per rank (lists indexed by rank): retries and the memory
telemetry (record.py lists what each means)."""


def _combine(engine: Engine, cfg: TrainConfig, per_rank: list[list[StepRow]],
             world: int, start: int = 0) -> dict:
    """Rows of steps ``start..start+n-1`` from every rank -> the engine's record entry (``n``:
    the steps every rank finished, ``cfg.steps - start`` unless interrupted)."""
    n = min(len(rows) for rows in per_rank)
    warmup = max(0, min(cfg.warmup, n - 1))  # [Note: resumed runs]
    measured = slice(warmup, n)
    steps = []
    for i in range(n):
        col = [r[i] for r in per_rank]
        entry = {
            "step": start + i,
            "loss": col[0].loss,  # already the mean over ranks, the same on every rank
            "time_s": max(c.time_s for c in col),
            "tokens": cfg.micro_batch * cfg.seq_len * world,
            "device_bytes": int(max(c.memory.device_bytes for c in col)),
            "peak_device_bytes": int(max(c.memory.peak_device_bytes for c in col)),
            "pool_bytes": int(max(c.memory.pool_bytes for c in col)),
        }
        entry.update((name, [get(c) for c in col]) for name, get in _PER_RANK.items())
        steps.append(entry)
    ranks = []
    for r, rows in enumerate(per_rank if n else []):
        rows = rows[:n]
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
