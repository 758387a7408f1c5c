"""The JSON record of a run (``--out``), its per-engine summaries and the markdown table.

Record layout (``schema: zbuf.run/1``)::

    command        "train" | "bench"
    config         the resolved TrainConfig
    model          name, params, flops_per_token, shape
    environment    torch / CUDA / NCCL / driver versions, GPU kind and count, host
    world_size     ranks
    simulated      null, or (``--simulate-world``) world_size, note (what the numbers mean),
                   link_gbps and link_gbps_default of the communication estimate
    engines[]      engine, status ("ok" | "failed" | "interrupted": the steps finished
                   before Ctrl-C or SIGTERM, rank 0's numbers only), error, setup_seconds,
                   start_step (0, or the checkpoint step a --resume run continued from),
                   warmup_steps (warm-up actually left out of the statistics),
                   resume_seconds, checkpoints[] (step, path, seconds: saves of this run
                   still on disk at its end), run_id (the checkpointed run's id, or null),
                   resumed_from (the checkpoint loaded, or null),
                   steps[] (step, loss [mean over ranks], time_s [slowest rank], tokens,
                            device_bytes, peak_device_bytes, pool_bytes [max over ranks],
                            and per rank (lists indexed by rank): alloc_retries [cumulative],
                            forward_peak_bytes, backward_peak_bytes, optimizer_peak_bytes
                            [torch's peak allocated bytes of each phase], reserved_peak_bytes,
                            pool_held_bytes, pool_idle_bytes [at the step's end],
                            pool_yielded_bytes [lent to the optimizer step], pool_reclaims,
                            torch_ooms, budget_bytes [the gather budget in force: planned,
                            then re-planned], replanned [the re-plan took effect here],
                            pool_budget_bytes [the pool's own budget at the step's end, after
                            its pressure policy's shrinks], pool_recovered [its one-shot
                            recovery has run], pool_alloc_failures [its allocations the
                            device refused in the step]),
                   per_rank[] (peak_device_bytes, allocated_peak_bytes, pool_high_water_bytes,
                               alloc_retries_total, alloc_retries_measured),
                   pool (rank 0's pool stats), schedule (zbuf schedule report), memory_cap,
                   notices[] (what the run changed of the options, shown live too, e.g. a
                   --gather-budget below the schedule's floor),
                   step_memory (zbuf engines, rank 0: the measured whole-step budget and the
                                pool/allocator events; see ``zbuf.memory.step``),
                   compile_phases[per rank] (the first step cut into phases, see
                                            ``compile_phases.CompilePhases``),
                   recompile_phases[per rank][] (the same for each later step that compiled:
                                                a re-plan, a new input shape),
                   communication (simulated runs: rank 0's per-step collective bytes and
                                  their time at link_gbps, ``simulate.CommEstimate``; never part
                                  of time_s),
                   summary (see ``summarize``; ``time_to_final_plan_s``: set-up plus every
                            step through the last re-plan's, issue 21's measure)
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Optional

from .compile_phases import PHASE_LABELS, PHASES
from .config import TrainConfig, format_bytes
from .metrics import model_flops_utilisation
from .simulate import SIMULATED_NOTE

__all__ = ["SCHEMA", "FIT_SCHEMA", "plans", "per_device_words", "ranks_text", "ac_text", "hardware_text",
           "budget_notices", "summarize", "make_record", "write_record", "load_record",
           "markdown", "phases_markdown", "slowest_phases", "merge_records", "run_label",
           "simulated_text"]

SCHEMA = "zbuf.run/1"
FIT_SCHEMA = "zbuf.fit/1"
"""What ``zbuf fit`` writes (train/fit.py): its search, not a run."""


def _find(obj: Any, keys: tuple[str, ...], how=max) -> Optional[float]:
    """Aggregate every numeric value stored under any of ``keys`` anywhere in ``obj``."""
    found: list[float] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if k in keys and isinstance(v, (int, float)) and not isinstance(v, bool):
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return how(found) if found else None


def budget_notices(requested: Optional[int], schedule: Optional[dict[str, Any]]) -> list[str]:
    """What a user must be told about the gather budget once the schedule is planned: a budget
    below the floor (the most gathered bytes one operation needs at once) is raised to it by the
    planner, which would otherwise go unsaid. ``requested``: ``--gather-budget`` (None: the
    rank-agreed free memory)."""
    plans = list((schedule or {}).get("graphs", []))
    if (schedule or {}).get("blocks"):  # the block frames' one plan, under the same names
        plans.append(schedule["blocks"])
    raised = [g for g in plans if g.get("budget_bytes", 0) > g.get("requested_budget_bytes", 0)]
    if not raised:
        return []
    asked = min(g["requested_budget_bytes"] for g in raised)
    what = (f"--gather-budget {format_bytes(requested)}" if requested is not None
            else f"the gather budget from free memory ({format_bytes(asked)})")
    floor = max(g["budget_bytes"] for g in raised)
    return [f"{what} is below the schedule's floor, the most gathered bytes one operation needs "
            f"at once; planned with {format_bytes(floor)} instead"]


def _retries_after(steps: list[dict[str, Any]], n: int) -> Optional[list[int]]:
    """Allocator retries per rank after the first ``n`` steps of the record (None: too short)."""
    if len(steps) <= n:
        return None
    last, base = steps[-1]["alloc_retries"], steps[n - 1]["alloc_retries"]
    return [int(a - b) for a, b in zip(last, base)]


def _phase_peaks(steps: list[dict[str, Any]]) -> Optional[dict[str, Optional[int]]]:
    """The largest peak of each phase over ``steps`` and ranks (None: not recorded)."""
    if not steps or "forward_peak_bytes" not in steps[0]:
        return None
    out: dict[str, Optional[int]] = {}
    for phase in ("forward", "backward", "optimizer"):
        vals = [v for s in steps for v in s[f"{phase}_peak_bytes"] if v is not None]
        out[phase] = max(vals) if vals else None
    return out


def _replan_steps(steps: list[dict[str, Any]]) -> list[int]:
    """The steps a re-plan took effect in (on any rank), in order."""
    return sorted({s["step"] for s in steps if any(s.get("replanned") or [])})


def _step_memory_summary(report: Optional[dict[str, Any]],
                         steps: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The whole-step budget of a zbuf engine: what was planned, measured and re-planned."""
    if not report:
        return None
    m = report.get("measured") or {}
    return {
        "planned_budget_bytes": m.get("planned_budget_bytes"),
        "measured_budget_bytes": m.get("budget_bytes"),
        "replanned": bool(m.get("replanned")),
        # A re-plan that changed only the weights kept for backward compiled nothing
        # ([Note: bounded re-plan] in zbuf/compile/replan.py).
        "recompiled": bool(m.get("recompiled")),
        "kept_bytes": m.get("kept_bytes"),
        "replan_steps": _replan_steps(steps),
        "limit_bytes": m.get("limit_bytes"),
        "pool_yields": sum(1 for s in steps for v in s.get("pool_yielded_bytes") or [] if v),
        "events": report.get("events"),
        "optimizer_offload": _offload_summary(report.get("optimizer_offload")),
    }


def _offload_summary(offload: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Where the optimizer's state lived and what moving it cost ([Note: offloading when the
    step does not fit] in zbuf/offload_choice.py); None where no offload was installed."""
    if not offload:
        return None
    keys = ("mode", "chosen_by", "why", "active", "offloaded_state_bytes",
            "resident_state_bytes", "device_slot_bytes", "bytes_moved_per_step",
            "exposed_ms_median", "window", "window_off", "window_sized_from")
    return {k: offload.get(k) for k in keys}


def slowest_phases(result: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The compile phases of the rank whose first step took longest (the step's time is that
    rank's), or None for records without them."""
    per_rank = [p for p in result.get("compile_phases") or [] if isinstance(p, dict)]
    if not per_rank:
        return None
    i = max(range(len(per_rank)), key=lambda r: per_rank[r]["first_step_s"])
    return dict(per_rank[i], rank=i)


def slowest_replans(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each later step that compiled (a re-plan's recompile, [Note: measure first, then spend]
    in zbuf/memory/step.py), in step order: the phases of the rank whose step took longest, as
    ``slowest_phases`` gives the first step's; [] for records without re-plan compiles."""
    by_step: dict[int, dict[str, Any]] = {}
    for rank, phases in enumerate(result.get("recompile_phases") or []):
        for p in phases or []:
            if not isinstance(p, dict):
                continue
            seen = by_step.get(p["step"])
            if seen is None or p["first_step_s"] > seen["first_step_s"]:
                by_step[p["step"]] = dict(p, rank=rank)
    return [by_step[step] for step in sorted(by_step)]


def run_label(eng: dict[str, Any]) -> str:
    """The name of an engine's run in tables and plots: ``zbuf``, or ``fsdp2:selective`` where
    the record's runs differ in activation checkpointing (records before labels: the engine)."""
    return eng.get("label") or eng["engine"]


def summarize(result: dict[str, Any], cfg: TrainConfig, flops_per_token: Optional[float],
              peak_flops: Optional[float]) -> dict[str, Any]:
    """Statistics over the measured steps (those after ``cfg.warmup``)."""
    steps = result["steps"]
    warmup = result.get("warmup_steps", cfg.warmup)  # shorter in a short resumed run
    measured = steps[warmup:]
    times = [s["time_s"] for s in measured]
    median = statistics.median(times)
    tps_gpu = cfg.micro_batch * cfg.seq_len / median
    final, replaced = plans(result.get("schedule"))
    return {
        "measured_steps": len(measured),
        "warmup_steps": warmup,
        "start_step": result.get("start_step", 0),
        "step_time_median_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_time_mean_s": statistics.fmean(times),
        "step_time_stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "tokens_per_s_per_gpu": tps_gpu,
        "tokens_per_s": tps_gpu * cfg.nproc,
        "mfu": model_flops_utilisation(flops_per_token, tps_gpu, peak_flops),
        "peak_device_bytes": max(r["peak_device_bytes"] for r in result["per_rank"]),
        "alloc_retries_per_rank": [r["alloc_retries_measured"] for r in result["per_rank"]],
        "alloc_retries_total_per_rank": [r["alloc_retries_total"] for r in result["per_rank"]],
        "first_step_s": steps[0]["time_s"],
        "time_to_final_plan_s": _time_to_final_plan(result, steps),
        "first_loss": steps[0]["loss"],
        "final_loss": steps[-1]["loss"],
        "losses": [s["loss"] for s in steps],
        "pool": {k: result["pool"][k] for k in ("hits", "misses", "high_water_bytes",
                                                  "budget_bytes", "evictions", "allocations")
                 if k in result["pool"]} if result.get("pool") else None,
        # Steps 3 on (0-based), as benches/plain_setup.py counts them: the measured step, the
        # re-plan's and the settle's may retry, the issues' "0 retries after step 2".
        "alloc_retries_after_step_2_per_rank": _retries_after(steps, 3),
        "phase_peak_bytes": _phase_peaks(measured),
        "step_memory": _step_memory_summary(result.get("step_memory"), steps),
        "schedule_budget_bytes": _find(final, ("budget_bytes",)),
        "schedule_peak_live_bytes": _find(final, ("peak_live_bytes", "peak_live_gathered_bytes")),
        "recompute": _recompute(final["graphs"]) or _block_recompute(result.get("step_memory")),
        "recompute_replaced": ([r for r in map(_recompute, replaced) if r]
                               or final.get("blocks", {}).get("recompute_replaced", [])),
        "compile_phases": slowest_phases(result),
    }


def _time_to_final_plan(result: dict[str, Any], steps: list[dict[str, Any]]) -> float:
    """Seconds from the engine's set-up to the end of the first step that ran the plan it kept:
    the first step, or the last step a re-plan took effect in ([Note: measure first, then
    spend] in zbuf/memory/step.py), with every step before it; what a user waits before the
    step time the summary reports."""
    last = max(_replan_steps(steps), default=steps[0]["step"])
    return result.get("setup_seconds", 0.0) + sum(s["time_s"] for s in steps if s["step"] <= last)


def plans(schedule: Optional[dict]) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """A zbuf schedule split by plan: the one in force when the record was written (its graphs
    and any block frames' schedule, as a schedule), and the graphs of each plan a re-plan
    replaced, oldest first. Graphs without a plan number (records before plans were numbered)
    count as the plan in force."""
    graphs = [g for g in (schedule or {}).get("graphs", []) if isinstance(g, dict)]
    last = max((g.get("plan", 0) for g in graphs), default=0)
    final = {"graphs": [g for g in graphs if g.get("plan", 0) == last]}
    if (schedule or {}).get("blocks"):
        final["blocks"] = schedule["blocks"]
    return final, [[g for g in graphs if g.get("plan", 0) == k] for k in range(last)]


def _recompute(graphs: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """What one plan's compiled step kept for backward and recomputes (its graphs' recompute
    stats, summed over its forward/backward pairs: each pair's two records carry the same)."""
    graphs = [g for g in graphs
              if g.get("kind") == "forward" and isinstance(g.get("recompute"), dict)]
    if not graphs:
        return None
    keys = ("regions", "regions_recomputed", "regions_selective", "regions_kept", "kept_bytes",
            "recomputed_bytes", "forward_flops", "recomputed_flops", "activation_peak_bytes")
    out: dict[str, Any] = {k: sum(g["recompute"][k] for g in graphs) for k in keys}
    out["activation_peak_bytes"] = max(g["recompute"]["activation_peak_bytes"] for g in graphs)
    out["mode"] = graphs[0]["recompute"]["mode"]
    return out


def _block_recompute(report: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Block frames' recompute levels, which no schedule records: those of the step memory's
    latest re-plan, else of the measured step ([Note: block levels] in
    zbuf/compile/block_replan.py)."""
    steady = (report or {}).get("steady") or {}
    decision = steady if steady.get("replanned") else ((report or {}).get("measured") or {})
    return decision.get("recompute")


def make_record(command: str, cfg: TrainConfig, env: dict[str, Any],
                engines: list[dict[str, Any]], peak_flops: Optional[float]) -> dict[str, Any]:
    mcfg = cfg.model_config()
    shape = cfg.preset if cfg.layers is None else f"{cfg.preset}, {cfg.layers} layers"
    name = f"hf:{cfg.hf_model} ({shape} shape)" if cfg.hf_model else shape
    fpt = mcfg.flops_per_token(cfg.seq_len)
    for eng in engines:
        # an interrupted run: the steps it finished ([Note: interrupted runs] in loop)
        if eng.get("status") == "ok" or eng.get("status") == "interrupted" and eng.get("steps"):
            eng["summary"] = summarize(eng, cfg, fpt, peak_flops)
    return {
        "schema": SCHEMA,
        "command": command,
        "config": cfg.to_json(),
        "model": {"name": name, "preset": cfg.preset, "params": mcfg.num_params(),
                  "flops_per_token": fpt, "peak_flops_per_gpu": peak_flops,
                  "shape": {k: v for k, v in vars(mcfg).items()}},
        "environment": env,
        "world_size": cfg.nproc,
        "simulated": None if not cfg.simulated else {
            "world_size": cfg.nproc, "note": SIMULATED_NOTE.format(world=cfg.nproc),
            "link_gbps": cfg.link_gbps,
            "link_gbps_default": TrainConfig.__dataclass_fields__["link_gbps"].default},
        "engines": engines,
    }


def simulated_text(record: dict[str, Any]) -> Optional[str]:
    """What a simulated record's numbers mean and its communication estimate per engine, for
    the terminal summary, ``zbuf report`` and the markdown table; None for a real run."""
    sim = record.get("simulated")
    if not sim:
        return None
    parts = []
    for eng in record["engines"]:
        c = eng.get("communication")
        if c:
            parts.append(f"{run_label(eng)} {format_bytes(c['all_gather_bytes'])} all-gathered, "
                         f"{format_bytes(c['reduce_scatter_bytes'])} reduce-scattered"
                         + (f", {format_bytes(c['all_reduce_bytes'])} all-reduced"
                            if c["all_reduce_bytes"] else "")
                         + f": {c['seconds'] * 1e3:.2f} ms")
    comm = (f" Communication estimate per rank and step at {sim['link_gbps']:g} Gbit/s "
            f"(default {sim['link_gbps_default']:g}), not in the step times: "
            + "; ".join(parts) + ".") if parts else ""
    return f"SIMULATED: {sim['note']}.{comm}"


def write_record(record: dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def load_record(path: str) -> dict[str, Any]:
    """The record at ``path``; ``ValueError`` naming the file and what is wrong with it
    (``FileNotFoundError`` when there is none)."""
    if os.path.isdir(path):
        found = [n for n in ("zbuf-train.json", "zbuf-bench.json")
                 if os.path.isfile(os.path.join(path, n))]
        example = os.path.join(path, found[0] if found else "zbuf-train.json")
        raise ValueError(f"{path} is a directory; give the run record's file, e.g. zbuf report "
                         f"{example}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a zbuf run record: not UTF-8 text") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{e.msg}: line {e.lineno}, column {e.colno}"  # e.msg may end in "at"
        # Every record is one object: a file that starts one and does not end it was cut off;
        # one that does not start with "{" was never a record ("not json {" read as truncated).
        if not text.lstrip().startswith("{"):
            raise ValueError(f"{path} is not a zbuf run record: not JSON ({where}); write one "
                             f"with zbuf train --out or zbuf bench --out") from None
        if not text.rstrip().endswith("}"):
            where = f"the file ends before the JSON does, so it is truncated ({where})"
        raise ValueError(f"{path} is not valid JSON: {where}; run again, or restore the file") \
            from None
    if isinstance(record, dict) and record.get("schema") == FIT_SCHEMA:
        raise ValueError(f"{path} is a zbuf fit record, not a run record: its search found "
                         f"{record.get('micro_batch')} the largest micro-batch that fits (each "
                         f"probe is in the file); zbuf report plots the records of zbuf train "
                         f"--out and zbuf bench --out")
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a zbuf run record (expected schema {SCHEMA!r}); "
                         f"write one with zbuf train --out or zbuf bench --out")
    return record


def hardware_text(env: dict[str, Any]) -> str:
    """The hardware a record ran on, for table headers: "2 x NVIDIA H200" or "CPU (2 cores)"."""
    if env.get("device_type") == "cuda":
        return f"{env.get('gpu_count', '?')} x {env.get('gpu')}"
    return f"CPU ({env.get('cpu_count')} cores)"


def ac_text(cfg: dict[str, Any]) -> str:
    """The header's activation checkpointing: the mode, or "per engine" when they differ."""
    if cfg.get("engine_ac") and len({m or cfg["ac"] for m in cfg["engine_ac"]}) > 1:
        return "per engine"
    ac = cfg["ac"]
    return {True: "full", False: "off"}.get(ac, ac)  # records written before the modes: bools


def ranks_text(n: int) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} rank{'' if n == 1 else 's'}"


def per_device_words(record: dict[str, Any]) -> tuple[str, str]:
    """What a rank runs on and what its peak memory is, for column names: ("GPU", "peak device
    mem") on CUDA; ("rank", "peak RSS") on CPU, where the peak is the process's resident set."""
    if record["environment"].get("device_type") == "cuda":
        return "GPU", "peak device mem"
    return "rank", "peak RSS"


def markdown(record: dict[str, Any]) -> str:
    """The benchmark table: one row per engine, versions and hardware in the header."""
    env, cfg = record["environment"], record["config"]
    hw = hardware_text(env)
    unit, memory = per_device_words(record)
    lines = [
        f"## {record['model']['name']}: micro-batch {cfg['micro_batch']} x seq {cfg['seq_len']}, "
        f"{ranks_text(record['world_size'])}, AC {ac_text(cfg)}, {cfg['dtype']}, "
        f"{cfg.get('optimizer', 'adamw')}"
        + (f", mem-frac {cfg['mem_frac']}" if cfg.get("mem_frac") else ""),
        "",
        f"Hardware: {hw}. torch {env.get('torch')}, CUDA {env.get('cuda') or '-'}, "
        f"NCCL {env.get('nccl') or '-'}, driver {env.get('driver') or '-'}; zbuf "
        f"{env.get('zbuf_commit') or env.get('zbuf') or '?'}. Steps: {cfg['warmup']} warm-up + "
        f"{cfg['steps'] - cfg['warmup']} measured.",
        "",
        f"| engine | step median (s) | min | max | tok/s/{unit} | MFU | {memory} | "
        "alloc retries/rank | first step (s) | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for eng in record["engines"]:
        if eng["status"] != "ok":
            last = (eng.get("error") or "").strip().splitlines()
            reason = last[-1].replace("|", "/") if last else ""
            lines.append(f"| {run_label(eng)} | {eng['status']}: {reason} | | | | | | | | |")
            continue
        s = eng["summary"]
        mfu = "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        lines.append(
            f"| {run_label(eng)} | {s['step_time_median_s']:.4f} | {s['step_time_min_s']:.4f} | "
            f"{s['step_time_max_s']:.4f} | {s['tokens_per_s_per_gpu']:,.0f} | {mfu} | "
            f"{format_bytes(s['peak_device_bytes'])} | "
            f"{','.join(map(str, s['alloc_retries_per_rank']))} | {s['first_step_s']:.2f} | "
            f"{s['final_loss']:.4f} |")
    sim = simulated_text(record)
    if sim:
        lines[1:1] = ["", f"**{sim}**"]
    phases = phases_markdown(record)
    return "\n".join(lines) + "\n" + ("\n" + phases if phases else "")


def phases_markdown(record: dict[str, Any]) -> str:
    """The first step cut into phases ([Note: compile phases]), one column per engine; empty
    when no engine recorded them."""
    engines = [e for e in record["engines"] if e.get("status") == "ok"
               and (e.get("summary") or {}).get("compile_phases")]
    if not engines:
        return ""
    ph = [e["summary"]["compile_phases"] for e in engines]
    lines = ["First step by phase (seconds, slowest rank; [Note: compile phases] in "
             "zbuf/train/compile_phases.py):", "",
             "| phase | " + " | ".join(run_label(e) for e in engines) + " |",
             "| --- |" + " ---: |" * len(engines)]
    for name in PHASES:
        lines.append(f"| {PHASE_LABELS[name]} | "
                     + " | ".join(f"{p['phases'].get(name, 0.0):.2f}" for p in ph) + " |")
    lines.append("| **first step** | " + " | ".join(f"**{p['first_step_s']:.2f}**" for p in ph)
                 + " |")
    names = sorted({k for p in ph for k in p.get("zbuf_passes", {})})
    for k in names:
        lines.append(f"| zbuf: {k} | " + " | ".join(
            f"{p.get('zbuf_passes', {}).get(k, 0.0):.3f}" for p in ph) + " |")
    lines.append("| first step CPU time (s, process + compilers) | "
                 + " | ".join(f"{p.get('cpu_s', 0.0):.1f}" for p in ph) + " |")
    lines.append("| kernel compile work (CPU s, all threads) | "
                 + " | ".join(f"{p.get('kernel_compile_work_s', 0.0):.1f}" for p in ph) + " |")
    for key, label in (("fxgraph", "FX-graph cache hit/miss"), ("aot", "AOT cache hit/miss")):
        lines.append(f"| {label} | " + " | ".join(
            f"{p.get('caches', {}).get(key + '_hit', 0)}/{p.get('caches', {}).get(key + '_miss', 0)}"
            for p in ph) + " |")
    if any(p.get("cache_bypass_reasons") for p in ph):
        lines.append("| cache bypassed because | " + " | ".join(
            "; ".join(p.get("cache_bypass_reasons", [])).replace("|", "/") or "-" for p in ph)
            + " |")
    return "\n".join(lines) + "\n"


# Config fields that may differ between records merged into one comparison. "budget" is the
# field of records written before it was split into gather_budget and pool_budget (each engine's
# own budget, so free as it was): such a record still merges with newer ones.
_MERGE_FREE = {"engines", "engine_ac", "ac", "out", "progress", "gather_budget", "pool_budget",
               "budget", "checkpoint_dir", "save_every", "keep_checkpoints", "resume_from",
               "allow_change", "collective_timeout_s"}


def merge_records(paths: list[str]) -> dict[str, Any]:
    """One bench record from several runs of the same configuration (e.g. one engine per job
    when a job's time limit cannot hold them all). Refuses records whose configuration,
    world size or hardware differ: their ratios would compare different things."""
    records = [load_record(p) for p in paths]
    base = records[0]
    key = lambda r: ({k: v for k, v in r["config"].items() if k not in _MERGE_FREE},
                     r["world_size"], r["environment"].get("gpu"),
                     r["environment"].get("torch"))
    for path, r in zip(paths[1:], records[1:]):
        if key(r) != key(base):
            a, b = key(base)[0], key(r)[0]
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"{path} does not match {paths[0]} (config fields {diff}, world "
                             f"size, GPU or torch version differ); merge only runs of one "
                             f"configuration")
    merged = dict(base)
    merged["command"] = "bench"
    entries = [dict(e, ac=e.get("ac") or ac_text(r["config"])) for r in records
               for e in r["engines"]]
    mixed = len({e["ac"] for e in entries}) > 1
    for e in entries:  # one comparison: labelled as one run of all of them would be
        e["label"] = f"{e['engine']}:{e['ac']}" if mixed else e["engine"]
    names = [e["label"] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"engines repeat across the merged records: {names}")
    merged["engines"] = entries
    merged["config"] = dict(base["config"], engines=[e["engine"] for e in entries],
                            engine_ac=[e["ac"] for e in entries] if mixed else [])
    merged["merged_from"] = [os.path.abspath(p) for p in paths]
    return merged
