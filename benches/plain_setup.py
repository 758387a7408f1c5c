"""A plain user setup against ``zbuf bench``'s zbuf engine, side by side in one run (issue 13).

The plain setup, as a new user writes it: a decoder of plain ``nn.Linear`` / ``nn.RMSNorm`` /
``F.scaled_dot_product_attention`` blocks (checkpointed per block), ``zbuf.shard``, then
``torch.compile(model, backend="zbuf")``, the loss computed outside the model, fused AdamW. The
bench engine: ``zbuf.train.engines.build_engine(Engine.ZBUF, ...)`` exactly as ``zbuf bench`` builds
it (the preset's model code, its loss compiled inside the graph, ``zbuf.compile``'s rank-agreed
budget, foreach AdamW). Between them, variants that each change one of those four factors of
the bench engine to the plain setup's, so that the step times say where a difference comes from:

    bench            zbuf bench's engine (build_engine)
    bench+fused      ... with fused AdamW
    bench+eager-loss ... with the loss computed outside the compiled model
    bench+torch.compile ... compiled with torch.compile(backend="zbuf"), no agreed budget
    bench+plain-model ... with the plain model code (same weights, same graph layout)
    plain            every factor the plain setup's
    zbuf.compile     the plain setup through the README's call, zbuf.compile(model, optimizer=opt)
                     with no other option (issue 36)
    zbuf.compile+auto ... with recompute="auto": the blocks kept, offloaded to host memory (on
                     CUDA) and recomputed as the measured room plans them
    fsdp2            the plain setup under FSDP2 as torchtitan runs it: fully_shard per block and
                     the root, each block compiled (run it with expandable segments, its best)

``--placement``: where the user checkpoints each block: inside the block's forward (``inside``),
around the block call in the parent's loop (``parent``, issue 36's crash), by
``apply_activation_checkpointing`` on the blocks (``wrapper``, torchtitan's full AC), inside the
block with torchtitan's op-level selective policy (``selective``: [Note: selective
checkpointing] in zbuf/models.py), or not at all (``none``). ``--attn-dropout P`` adds dropout
to the attention (the checkpoint then replays the RNG, unless ``--no-preserve-rng-state``).

Every variant starts from the same weights (the plain decoder loads the preset's state dict)
and trains on the same synthetic batches. Per variant: median step time (10 warm-up steps by
default), spread, peak device memory (allocator reserved + the zbuf pool), first step, losses,
and what the compiled graphs planned (budget, weights kept for backward, modelled exposed
gathers, activation peak, what was recomputed). One rank, or several under torchrun:

    python benches/plain_setup.py --preset qwen3-8b --layers 4 --micro-batch 4 --seq-len 4096
    torchrun --nproc_per_node 2 benches/plain_setup.py --preset qwen3-8b ...
    python benches/plain_setup.py --preset qwen3-14b --simulate-world 8 --gpu-memory 80GiB ...

``--simulate-world N`` runs it as rank 0 of N over torch's fake process group ([Note: simulated
ranks] in zbuf/train/simulate.py): every model is built on the meta device and materialised
shard by shard by ``zbuf.shard(device=...)`` (the plain decoder is not loaded with the preset's
weights then: under the fake group no weights are real), step times exclude communication and
losses mean nothing. ``--gpu-memory SIZE`` emulates a card of that size for torch's allocator and
the variant's zbuf pool together (``zbuf.memory.SharedMemory.emulate_capacity``).

On CPU (gloo, tiny shapes) the step times mean little; the planned numbers compare the graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import functools
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing, checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

VARIANTS = ("bench", "bench+fused", "bench+eager-loss", "bench+torch.compile",
            "bench+plain-model", "plain", "zbuf.compile", "zbuf.compile+auto", "fsdp2")
PLACEMENTS = ("inside", "parent", "wrapper", "selective", "none")


class UserCheckpointing(NamedTuple):
    """How the user's own code checkpoints its blocks."""

    placement: str
    """One of ``PLACEMENTS``."""
    attn_dropout: float = 0.0
    """Dropout probability inside the attention (training mode)."""
    preserve_rng_state: bool = True
    """``checkpoint``'s own argument: replay the RNG in the recompute."""

    def checkpoint(self, fn, *args):
        if self.placement == "selective":
            from zbuf.models import selective_checkpoint_context

            return checkpoint(fn, *args, use_reentrant=False,
                              preserve_rng_state=self.preserve_rng_state,
                              context_fn=selective_checkpoint_context)
        return checkpoint(fn, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state)



# ----------------------------------------------------------------------------- the plain model
class PlainAttention(nn.Module):
    def __init__(self, cfg, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PlainMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PlainBlock(nn.Module):
    def __init__(self, cfg, ac: UserCheckpointing) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = PlainAttention(cfg, ac.attn_dropout)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = PlainMLP(cfg)
        self.ac = ac

    def _body(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin):
        if self.ac.placement in ("inside", "selective"):
            return self.ac.checkpoint(self._body, x, cos, sin)
        return self._body(x, cos, sin)


class PlainDecoder(nn.Module):
    """The preset's architecture in plain modules, with the preset's parameter names."""

    def __init__(self, cfg, ac: UserCheckpointing) -> None:
        super().__init__()
        self.config = cfg
        self.ac = ac
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(PlainBlock(cfg, ac) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                  bias=False)
        if ac.placement == "wrapper":  # its state dict keeps the plain names
            apply_activation_checkpointing(
                self, check_fn=lambda m: isinstance(m, PlainBlock),
                checkpoint_wrapper_fn=functools.partial(
                    checkpoint_wrapper, preserve_rng_state=ac.preserve_rng_state))

    def forward(self, tokens):
        from zbuf.models import rotary_tables

        h = self.embed_tokens(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta,
                                 h.device, h.dtype)
        for layer in self.layers:
            if self.ac.placement == "parent":
                h = self.ac.checkpoint(layer, h, cos, sin)
            else:
                h = layer(h, cos, sin)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(h), head)


# ----------------------------------------------------------------------------- one variant
def _loss(logits, targets):
    """The loss as the user writes it (the bench engine's is models.cross_entropy)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


class _WithLoss(nn.Module):
    """The model with the bench engine's loss, compiled with it."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        from zbuf.models import cross_entropy

        return cross_entropy(self.model(tokens), targets)


def _fsdp2(model, cfg, device, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zbuf.train.engines import init_module

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for block in model.layers:
        block.compile(backend=cfg.compiler, fullgraph=True)
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if any(p.is_meta for p in model.parameters()):  # this rank's shards only, then initialised
        model.to_empty(device=device)
        with torch.no_grad():
            for sub in model.modules():
                init_module(sub, model)
    return model


def _setup(variant: str, cfg, device, dtype, user_ac: UserCheckpointing):
    """(step_loss(batch) -> loss, optimizer, the sharded model, its pool) of one variant."""
    import zbuf
    from zbuf.pool import default_pool
    from zbuf.train.engines import build_base_model, build_engine
    from zbuf.train.config import Engine

    if variant == "bench":
        setup = build_engine(Engine.ZBUF, cfg, device)
        return setup.step_loss, setup.optimizer, setup.model, setup.pool
    readme_call = variant.startswith("zbuf.compile")  # zbuf.compile(model, optimizer=opt, ...)
    plain = readme_call or variant in ("bench+plain-model", "plain", "fsdp2")
    ac = user_ac if cfg.ac != "off" else user_ac._replace(placement="none")
    if cfg.simulated:  # meta models, materialised shard by shard by zbuf.shard below
        if plain:
            with torch.device("meta"):
                model = PlainDecoder(cfg.model_config(), ac=ac)
        else:
            model = build_base_model(cfg, device, materialise=False)
    else:
        preset = build_base_model(cfg, device)
        if plain:
            model = PlainDecoder(cfg.model_config(), ac=ac).to(device)
            model.load_state_dict(preset.state_dict())
        else:
            model = preset
    eager_loss = readme_call or variant in ("bench+eager-loss", "plain", "fsdp2")
    fused = readme_call or variant in ("bench+fused", "plain", "fsdp2")
    if variant == "fsdp2":
        model = _fsdp2(model, cfg, device, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
        return lambda batch: _loss(model(batch.tokens), batch.targets), opt, model, None
    zbuf.shard(model, param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
               device=device)
    target = model if eager_loss else _WithLoss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0,
                            **({"fused": True} if fused else {}))
    # The bench engine's compiler (Inductor on GPU; aot_eager on CPU, where Inductor's C++
    # compile would dwarf everything).
    inner = {} if cfg.compiler == "inductor" else {"inner": cfg.compiler}
    if variant == "zbuf.compile":
        compiled = zbuf.compile(target, optimizer=opt, **inner)
    elif variant == "zbuf.compile+auto":  # the measured room planned: kept, offloaded, recomputed
        compiled = zbuf.compile(target, optimizer=opt, recompute="auto", **inner)
    elif variant in ("bench+torch.compile", "plain"):
        compiled = torch.compile(target, backend="zbuf", **({"options": inner} if inner else {}))
    else:  # as the bench engine calls it (train/engines.py)
        compiled = zbuf.compile(target, fullgraph=True, optimizer=opt,
                                recompute="auto" if cfg.ac == "auto" else "checkpointed", **inner)

    def step_loss(batch):
        if eager_loss:
            return _loss(compiled(batch.tokens), batch.targets)
        return compiled(batch.tokens, batch.targets)

    return step_loss, opt, model, default_pool(device)


def _planned(model) -> dict:
    import zbuf
    from zbuf.compile.block_frames import block_frames_of

    recs = zbuf.schedule_report(model)
    out = {"graphs": len(recs)}
    for r in recs:
        k = r.kind
        out[f"{k}_budget_bytes"] = r.budget_bytes
        out[f"{k}_activation_peak_bytes"] = r.activation_peak_bytes
        out[f"{k}_peak_live_gathered_bytes"] = r.peak_live_gathered_bytes
        out[f"{k}_modelled_exposed_ms"] = 1e3 * r.modelled_exposed_seconds
        out[f"{k}_modelled_compute_ms"] = 1e3 * r.modelled_compute_seconds
        out["persistent_bytes"] = r.persistent_bytes
        if r.recompute is not None:
            out["recompute"] = r.recompute.to_dict()
    frames = block_frames_of(model)
    if frames is not None:  # the block structure: each call's level, and what went to host
        schedule = frames.schedule()
        out["block_levels"] = schedule["levels"]
        out["activation_offload"] = schedule["activation_offload"]
        out["measured_block_forward_ms"] = schedule["measured_block_forward_ms"]
    memory = zbuf.compile.step_memory_of(model)
    if memory is not None:  # where the optimizer's state lived, and who chose (issue 38)
        report = memory.report()
        out["optimizer_offload"] = report["optimizer_offload"]
        out["torch_allocator"] = report["torch_allocator"]
        if frames is not None:  # the blocks' modelled recompute
            stats = memory.replanner.recompute_stats()
            if stats is not None:
                out["recompute"] = stats.to_dict()
    return out


def _reserved_peak(model, device) -> int:
    """torch's reserved peak since the variant began. ``zbuf.compile``'s phase meter resets the
    device's peak counters at every phase boundary ([Note: phase peaks] in
    zbuf/memory/phases.py): the earlier phases' peaks are in its rows, the open step's in its
    row so far."""
    import zbuf

    peaks = [torch.cuda.max_memory_reserved(device)]
    memory = zbuf.compile.step_memory_of(model)
    if memory is not None:
        peaks += [row.phases.reserved_peak_bytes for row in memory.rows]
        peaks.append(memory.meter.reserved_peak_so_far())
    return max(peaks)


def run_variant(variant: str, cfg, device, dtype, rank: int, world: int,
                user_ac: UserCheckpointing = UserCheckpointing("inside"),
                profile_dir: str | None = None, trace_step: int | None = None,
                out_dir: str | None = None) -> dict:
    from allocator_retries import recorded
    from zbuf.train.compile_phases import PhaseClock
    from zbuf.train.data import rank_batch
    from zbuf.train.simulate import collective_bytes, step_communication

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    card = None
    if cfg.gpu_memory is not None and device.type == "cuda":
        # Before the build, so that zbuf.compile's agreed budget sees the card; the pool's share
        # follows once the variant's pool exists ([Note: emulated capacity] in zbuf/memory/shared.py).
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cfg.gpu_memory / total, device)
    step_loss, opt, model, pool = _setup(variant, cfg, device, dtype, user_ac)
    if cfg.gpu_memory is not None and device.type == "cuda" and pool is not None:
        from zbuf.memory import SharedMemory

        card = SharedMemory(pool)
        card.emulate_capacity(cfg.gpu_memory)
    retries = []
    # Per step, cumulative: torch's allocator's cudaMallocs and the pool's device allocations, to
    # see segments made again every step (a cache emptied under pressure, which no retry counts).
    device_allocs = []
    # Where each warm-up step's time went ([Note: compile phases] in
    # zbuf/train/compile_phases.py): the first step's and a re-plan's compile against their run
    # (the re-plan's step set the 14B inside placement's time to the final plan at 1.500x
    # FSDP2's first step).
    phases_by_step: dict[int, dict] = {}
    # Which requests made torch's allocator retry in step ``trace_step``
    # (benches/allocator_retries.py).
    allocator_trace: dict | None = None
    times, losses = [], []
    vocab = cfg.model_config().vocab_size

    def batch_of(step: int):
        return rank_batch(cfg.task, cfg.seed, step, cfg.micro_batch, world, rank, cfg.seq_len,
                          vocab, device)

    def train_step(batch) -> torch.Tensor:
        loss = step_loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss

    def steps_so_far() -> dict:
        """What every step recorded, and the plan that ran them: in a failure's record too."""
        return {"step_s": times, "losses": losses, "alloc_retries_by_step": retries,
                "device_allocs_by_step": device_allocs, "planned": _planned(model),
                "compile_phases_by_step": phases_by_step, "allocator_trace": allocator_trace,
                **_memory_of(model)}

    counted_at_warmup = None  # zbuf's collectives' bytes when the measured steps begin
    try:
        for step in range(cfg.steps):
            if step == cfg.warmup and pool is not None:
                counted_at_warmup = collective_bytes(model)
            batch = batch_of(step)
            clock = PhaseClock() if step < max(cfg.warmup, 1) else None
            traced = step == trace_step and device.type == "cuda"
            history = None  # the traced step's history kept beside the record, to read again
            if traced and out_dir is not None:
                os.makedirs(out_dir, exist_ok=True)
                history = os.path.join(out_dir, f"allocation_history_{variant.replace('+', '-')}"
                                                f"_step{step}.json.gz")
            with clock or contextlib.nullcontext(), \
                    recorded(device, history=history) if traced else contextlib.nullcontext() \
                    as trace:
                t0 = time.perf_counter()
                loss = train_step(batch)
                times.append(time.perf_counter() - t0)
            if traced:
                allocator_trace = {"step": step, **trace}
            if clock is not None:
                phases_by_step[step] = clock.result(times[-1]).to_json()
            losses.append(loss.item())
            if device.type == "cuda":
                stats = torch.cuda.memory_stats(device)
                retries.append(stats.get("num_alloc_retries", 0))
                device_allocs.append([stats.get("num_device_alloc", 0),
                                      pool.stats().allocations if pool is not None else 0])
    except (torch.OutOfMemoryError, MemoryError) as e:
        # A variant that runs out of memory (or whose plan zbuf refuses) is a result, not the end
        # of the run: the others still run, and the record says at which step and why, with the
        # plan and the steps before it (the 14B parent placement's step-2 failure had neither).
        out = {"variant": variant, "status": _failure(e), "failed_step": len(times),
               "error": str(e).splitlines()[0][:400], **steps_so_far(),
               "peak_reserved_bytes": _reserved_peak(model, device)
               if device.type == "cuda" else 0,
               "cache_at_failure": _cache_of(device) if device.type == "cuda" else None}
        # The step's closures hold these cells: emptied, not deleted, so the variant's memory goes.
        step_loss = opt = model = pool = card = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return out
    if profile_dir is not None:  # extra steps after the measured ones ([Note: profiled steps])
        from zbuf.train.profile import PROFILED_STEPS, StepProfiler

        with StepProfiler(profile_dir, variant, rank):
            for step in range(cfg.steps, cfg.steps + PROFILED_STEPS):
                train_step(batch_of(step))
    measured = times[cfg.warmup:]
    # The steps that compiled (a first step, a re-plan's): more than twice the measured median.
    compiled_steps = [i for i, t in enumerate(times[:cfg.warmup or 1])
                      if i == 0 or t > 2 * statistics.median(measured)]
    # The steps a re-plan took effect in, compiled or not (zbuf's rows say: StepMemoryRow): the
    # final plan runs from the last of them, as `zbuf train`'s record counts it (record.py).
    import zbuf

    memory = zbuf.compile.step_memory_of(model)
    replanned = ([] if memory is None else
                 [row.phases.step for row in memory.rows if row.replanned and
                  row.phases.step < len(times)])
    # zbuf's collectives counted over the measured steps; FSDP2's derived from its sharding.
    counted = None if counted_at_warmup is None else tuple(
        (n - w) // len(measured) for n, w in zip(collective_bytes(model), counted_at_warmup))
    communication = step_communication("zbuf" if pool is not None else variant, world,
                                       cfg.link_gbps, model, counted, dtype)
    peak = reserved = 0
    if device.type == "cuda":
        reserved = _reserved_peak(model, device)
        peak = reserved + (pool.stats().high_water_bytes if pool is not None else 0)
    out = {"variant": variant, "status": "ok", "step_ms_median": 1e3 * statistics.median(measured),
           "step_ms_min": 1e3 * min(measured), "step_ms_max": 1e3 * max(measured),
           "first_step_s": times[0],
           "mfu": _mfu(cfg, device, statistics.median(measured)),
           "communication": communication.to_json(),
           "time_to_final_plan_s": sum(times[:max(compiled_steps + replanned) + 1]),
           "compiled_steps": compiled_steps, "replanned_steps": replanned,
           "warmup_step_s": times[:cfg.warmup],
           "peak_device_bytes": peak, "peak_reserved_bytes": reserved,
           "alloc_retries_warmup": retries[cfg.warmup - 1] if retries and cfg.warmup else 0,
           "alloc_retries_measured": (retries[-1] - (retries[cfg.warmup - 1] if cfg.warmup else 0))
           if retries else 0,
           # The issue's measure: retries once the measured step has re-planned (steps 0-2).
           "alloc_retries_after_step2": retries[-1] - retries[2] if len(retries) > 3 else 0,
           **steps_so_far(),
           "card": card.capacity_fraction() if card is not None else None}
    # The step's closures hold these cells: emptied, not deleted, so the variant's memory goes.
    step_loss = opt = model = pool = card = None
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return out


def _memory_of(model) -> dict:
    """zbuf's own account of the card, step by step (none for FSDP2): each closed step's row
    (``StepMemoryRow``: every phase's allocated and reserved peaks, what the pool held, lent to
    the optimizer step and reclaimed, the budget in force) and the counts of the pool's and
    torch's trading of memory (``MemoryEvents``). At 32B the pool re-allocated its blocks every
    step beside one torch retry a step (benches/results/onepath32b.md); these say where."""
    import zbuf

    memory = zbuf.compile.step_memory_of(model)
    if memory is None:
        return {}
    rows = [{**row.phases._asdict(), **{k: v for k, v in row._asdict().items() if k != "phases"}}
            for row in memory.rows]
    return {"memory_rows": rows, "memory_events": dataclasses.asdict(memory.memory.events)}


def _mfu(cfg, device, step_s: float):
    """Model FLOPs utilisation of the median step, or None where the device's peak is unknown
    (``zbuf bench``'s, from the preset's FLOPs per token)."""
    from zbuf.train.metrics import model_flops_utilisation, peak_flops_per_second

    return model_flops_utilisation(cfg.model_config().flops_per_token(cfg.seq_len),
                                   cfg.micro_batch * cfg.seq_len / step_s,
                                   peak_flops_per_second(device, None, cfg.dtype))


def _cache_of(device: torch.device) -> dict:
    """What torch's cache held when an allocation failed: whether the free bytes were in one
    piece, and on which streams, in which kind of segment, the pieces lay."""
    segments = [seg for seg in torch.cuda.memory_snapshot() if seg["device"] == device.index]
    free = [b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive"]
    by_stream: dict[str, dict] = {}
    for seg in segments:
        kind = "expandable" if seg.get("is_expandable") else "segments"
        row = by_stream.setdefault(f"{seg['stream']}/{kind}",
                                   {"segments": 0, "reserved_bytes": 0, "allocated_bytes": 0})
        row["segments"] += 1
        row["reserved_bytes"] += seg["total_size"]
        row["allocated_bytes"] += seg["allocated_size"]
    return {"segments": len(segments),
            "reserved_bytes": sum(seg["total_size"] for seg in segments),
            "allocated_bytes": sum(seg["allocated_size"] for seg in segments),
            "largest_free_block_bytes": max(free, default=0),
            "free_in_used_segments_bytes": sum(seg["total_size"] - seg["allocated_size"]
                                               for seg in segments if seg["allocated_size"]),
            "by_stream_and_kind": by_stream}


def _failure(e: BaseException) -> str:
    from zbuf.compile.budget import PlanExceedsMemoryError

    return "refused" if isinstance(e, PlanExceedsMemoryError) else "oom"


# ----------------------------------------------------------------------------- main
def _comm_cell(communication, world: int) -> str:
    """The communication estimate's time at its link, or "-" for one rank (nothing to move)."""
    if not communication or world < 2:
        return "-"
    return f"{1e3 * communication['seconds']:.1f} ms at {communication['link_gbps']:g} Gbit/s"


def markdown(result: dict) -> str:
    a = result["args"]
    base = next((r for r in result["variants"] if r["variant"] == "bench"
                 and r.get("status", "ok") == "ok"), None)
    lines = [f"## Plain setup vs zbuf bench's engine: {a['preset']}"
             + (f", {a['layers']} layers" if a.get("layers") else "")
             + f", micro-batch {a['micro_batch']} x seq {a['seq_len']}, {result['world']} rank(s)"
             + (" (SIMULATED: rank 0 of them over the fake group; step times exclude "
                "communication, losses are not meaningful)" if result.get("simulated") else "")
             + (f", card {result['gpu_memory_bytes'] / (1 << 30):.1f} GiB"
                if result.get("gpu_memory_bytes") else "")
             + f", AC {a['ac']}"
             + (f", the user's checkpoint: {a['placement']}" if a.get("placement") else "")
             + (f", attention dropout {a['attn_dropout']}" if a.get("attn_dropout") else "")
             + ("" if a.get("preserve_rng_state", True) else ", preserve_rng_state=False")
             + f", {result['device']}",
             "", f"torch {result['torch']}; {a['warmup']} warm-up + {a['steps'] - a['warmup']} "
                 f"measured steps. Ratios against `bench`.", "",
             "| variant | step median (ms) | min-max | vs bench | MFU | comm. estimate | "
             "peak memory | peak reserved | "
             "retries warm-up/measured/after step 2 | first step (s) | final loss | "
             "budget fw/bw | kept weights | modelled exposed fw/bw (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]
    gib = float(1 << 30)
    for r in result["variants"]:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['variant']} | **{r['status']} in step {r['failed_step']}**: "
                         f"{r['error']} | | | | | | {r['peak_reserved_bytes'] / gib:.2f} GiB |"
                         " | | | | | |")
            continue
        p = r["planned"]
        ratio = f"{r['step_ms_median'] / base['step_ms_median']:.3f}x" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['step_ms_median']:.1f} | {r['step_ms_min']:.1f}-"
            f"{r['step_ms_max']:.1f} | {ratio} | "
            f"{'-' if r.get('mfu') is None else format(100 * r['mfu'], '.1f') + ' %'} | "
            f"{_comm_cell(r.get('communication'), result['world'])} | "
            f"{r['peak_device_bytes'] / gib:.2f} GiB | {r.get('peak_reserved_bytes', 0) / gib:.2f} "
            f"GiB | {r.get('alloc_retries_warmup', 0)}/{r.get('alloc_retries_measured', 0)}/"
            f"{r.get('alloc_retries_after_step2', '-')} | {r['first_step_s']:.1f} | "
            f"{r['losses'][-1]:.4f} | {p.get('forward_budget_bytes', 0) / gib:.1f}/"
            f"{p.get('backward_budget_bytes', 0) / gib:.1f} GiB | "
            f"{p.get('persistent_bytes', 0) / gib:.2f} GiB | "
            f"{p.get('forward_modelled_exposed_ms', 0):.1f}/{p.get('backward_modelled_exposed_ms', 0):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from zbuf.train.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ac", default=None, choices=["off", "full", "auto"])
    p.add_argument("--placement", default="inside", choices=PLACEMENTS,
                   help="where the user checkpoints each block (with --ac full)")
    p.add_argument("--attn-dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability in the attention")
    p.add_argument("--no-preserve-rng-state", dest="preserve_rng_state", action="store_false",
                   help="the user's checkpoint does not replay the RNG in its recompute")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--simulate-world", type=int, default=None, metavar="N",
                   help="run as rank 0 of N over torch's fake process group")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="emulate a card of this size (torch's allocator and the pool together)")
    p.add_argument("--out", default=None, help="directory for plain_setup.{json,md}")
    p.add_argument("--trace-step", type=int, default=None, metavar="N",
                   help="record step N's allocation history on CUDA and put the requests that "
                        "made torch's allocator retry in the record (allocator_trace); with "
                        "--out, keep the history there too (python3 "
                        "benches/allocator_retries.py FILE reads it again)")
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="profile two extra steps per variant: a trace and a summary of where the "
                        "device's time goes, per variant, in DIR")
    args = p.parse_args()
    from zbuf.train.errors import ConfigError
    from zbuf.train.options import BYTES

    try:
        card = None if args.gpu_memory is None else BYTES.parse("--gpu-memory", args.gpu_memory)
    except ConfigError as e:
        p.error(str(e))
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    if card is not None and total is not None and card > total:
        p.error(f"--gpu-memory {args.gpu_memory} is more than this GPU's {total / (1 << 30):.1f} "
                f"GiB ({torch.cuda.get_device_name(0)}): it emulates a smaller card; give at most "
                f"{total >> 20}MiB")
    if args.simulate_world is not None:
        if args.simulate_world < 2 or "RANK" in os.environ:
            p.error("--simulate-world N: N >= 2, in one process (not under torchrun)")
        from zbuf.train.simulate import init_fake_group

        init_fake_group(args.simulate_world)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
        else:
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                    store=dist.HashStore())
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = TrainConfig(preset=args.preset, layers=args.layers, micro_batch=args.micro_batch,
                      seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, ac=args.ac,
                      simulate_world=args.simulate_world, gpu_memory=card,
                      progress=False).resolve(cuda=cuda, world=world, bench=True)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else None
    from zbuf.memory import users_allocator_settings

    results = []
    result = {"args": {**vars(args), "preset": cfg.preset, "micro_batch": cfg.micro_batch,
                       "seq_len": cfg.seq_len, "ac": cfg.ac},
              "world": world, "simulated": args.simulate_world is not None,
              "gpu_memory_bytes": card,
              "device": torch.cuda.get_device_name(device) if cuda else "CPU",
              "torch": torch.__version__,
              # The run's own allocator settings (FSDP2's expandable segments come from run.sh);
              # a zbuf variant that finds none turns them on itself and records it.
              "allocator_settings": users_allocator_settings(os.environ),
              "variants": results}
    for v in variants:
        user_ac = UserCheckpointing(args.placement, args.attn_dropout, args.preserve_rng_state)
        results.append(run_variant(v, cfg, device, dtype, rank, world, user_ac,
                                   args.profile_dir, args.trace_step, args.out))
        if rank != 0:
            continue
        r = results[-1]
        if r["status"] == "ok":
            print(f"{v:22s} {r['step_ms_median']:9.1f} ms  first {r['first_step_s']:6.1f} s  "
                  f"final plan {r['time_to_final_plan_s']:6.1f} s  "
                  f"peak {r['peak_device_bytes'] / (1 << 30):6.2f} GiB  retries after step 2 "
                  f"{r['alloc_retries_after_step2']}  loss {r['losses'][-1]:.4f}", flush=True)
        else:
            print(f"{v:22s} {r['status']} in step {r['failed_step']}: {r['error']}", flush=True)
        if args.out:  # after every variant, so that a run stopped by a time limit keeps the rest
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "plain_setup.json"), "w") as f:
                json.dump(result, f, indent=1)
            with open(os.path.join(args.out, "plain_setup.md"), "w") as f:
                f.write(markdown(result))
    if rank == 0:
        print(markdown(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
