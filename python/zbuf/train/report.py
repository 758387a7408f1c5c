"""``zbuf report RUN.json``: PNG plots and the schedule as a table, readable without the code.

Plots (one PNG each, written next to the record or into ``-o DIR``):

- ``loss.png``: loss per step, one line per engine.
- ``step_time.png``: step time per step per engine; the warm-up steps are shaded.
- ``memory.png``: device memory per step per engine (allocator reserved + pool, or RSS on
  CPU), with the zbuf pool's occupancy drawn dashed.
- ``recompute.png`` (zbuf runs; under block frames, ``--ac auto`` ones, the only mode whose
  frames measure what they keep): activations kept for backward and recomputed, in bytes, and
  the FLOPs backward re-runs against the forward's, with the blocks kept / selective /
  recomputed; the plan in force, and each plan a re-plan replaced, pale and hatched.
- ``schedule_memory.png`` (zbuf runs): per compiled graph, live gathered bytes over the graph's
  nodes against the budget and the projected activations when the schedule report carries the
  per-node profiles, otherwise budget / peak live gathered / activation peak / persistent bytes
  per graph as bars; under block frames (``--compile-structure blocks``), the planned live
  gathered bytes per block call, forward then backward.
- ``compile_phases.png``: the first step of each engine as a stacked bar of its phases (Dynamo,
  AOT, zbuf passes, Inductor, kernel compile, first run; [Note: compile phases] in
  ``compile_phases.py``), for records that carry them.
- ``step_memory.png`` (records with per-phase telemetry): per engine and step, torch's peak of
  each phase (forward, backward, optimizer), the pool's bytes held and idle, the gather budget
  as planned and as re-planned, and per rank the allocator's retries and the idle bytes the pool
  lent to the optimizer step ([Note: whole-step budget] in zbuf/memory/step.py).

The terminal shows the first step by phase with the time to the final plan, each re-plan's
recompile by phase (its compile against the first step's), the schedule table and, for such
records, the step-memory table.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from .compile_phases import PHASE_LABELS, PHASES
from .config import format_bytes
from .progress import flop_unit, print_error, print_table
from .record import load_record, ranks_text, run_label, simulated_text, slowest_replans

__all__ = ["make_plots", "schedule_table", "block_schedule_table", "step_memory_table",
           "phases_table", "replan_phases_table", "main"]

_GIB = float(1 << 30)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _ok(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs with steps to plot: those that completed, and an interrupted one's steps done."""
    return [e for e in record["engines"]
            if e.get("status") in ("ok", "interrupted") and e.get("steps")]


def _title(record: dict[str, Any], what: str) -> str:
    cfg = record["config"]
    stopped = any(e.get("status") == "interrupted" and e.get("steps") for e in record["engines"])
    return (f"{what}: {record['model']['name']}, {ranks_text(record['world_size'])}"
            + (" (simulated)" if record.get("simulated") else "")
            + (" (interrupted)" if stopped else "") +
            f", {cfg['micro_batch']}x{cfg['seq_len']} tokens/rank")


def _byte_unit(top: float) -> tuple[float, str]:
    """(scale, name) of the binary unit that shows ``top`` bytes as a number >= 1."""
    for scale, name in ((_GIB, "GiB"), (float(1 << 20), "MiB"), (1024.0, "KiB")):
        if top >= scale:
            return scale, name
    return 1.0, "B"


def _steps(eng: dict[str, Any]) -> list[int]:
    """An engine's steps numbered as the console numbers them: from 1 (the record counts from
    0; plots showed steps 0-29 of a run the console showed as 1-30)."""
    return [s["step"] + 1 for s in eng["steps"]]


_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"))
"""Line style and marker per engine, in turn: engines whose curves are identical (FSDP2 and DDP
train the same numbers) still show every line, dashes and hollow markers over one another."""


def _engine_style(i: int) -> dict[str, Any]:
    line, marker = _STYLES[i % len(_STYLES)]
    return {"linestyle": line, "marker": marker, "markersize": 4, "markerfacecolor": "none",
            "linewidth": 1.6 if i == 0 else 1.2}


def _plain_ticks(ax) -> None:
    """Numbers on the y axis as they are: no ``1e-5`` offset text over the title."""
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _loss_plot(record, out_dir) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, eng in enumerate(_ok(record)):
        ax.plot(_steps(eng), [s["loss"] for s in eng["steps"]], label=run_label(eng),
                **_engine_style(i))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(_title(record, "Training loss"))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, os.path.join(out_dir, "loss.png"))


def _step_time_plot(record, out_dir) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    shaded = False
    for i, eng in enumerate(_ok(record)):
        ax.plot(_steps(eng), [s["time_s"] * 1e3 for s in eng["steps"]], label=run_label(eng),
                **_engine_style(i))
        # A resumed run starts at its checkpoint's step; its warm-up starts there too.
        start = eng.get("start_step", 0) + 1
        warmup = eng.get("warmup_steps", record["config"]["warmup"])
        if warmup:
            ax.axvspan(start - 0.5, start + warmup - 0.5, color="grey", alpha=0.15,
                       label=None if shaded else "warm-up (not measured)")
            shaded = True
    ax.set_yscale("log")
    # Milliseconds as numbers: within a decade log scale labelled its minor ticks "6x10^3";
    # over a decade or two it left the steady steps (200 ms under a 4 s first step) with no
    # label, so the minor ticks at 2 and 5 of each decade get one too.
    from matplotlib.ticker import FuncFormatter

    def ms(v: float) -> str:
        return f"{v:,.0f}" if v >= 10 else f"{v:g}"

    span = ax.dataLim.y1 / ax.dataLim.y0 if ax.dataLim.y0 > 0 else float("inf")

    def minor(v: float, _) -> str:
        mantissa = round(v / 10 ** math.floor(math.log10(v)))
        return ms(v) if span < 10 or (span < 100 and mantissa in (2, 5)) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: ms(v)))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, slowest rank, log scale)")
    ax.set_title(_title(record, "Step time"))
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _save(fig, os.path.join(out_dir, "step_time.png"))


def _memory_plot(record, out_dir) -> str:
    plt = _plt()
    cuda = record["environment"].get("device_type") == "cuda"
    pooled = [e for e in _ok(record) if any(s.get("pool_bytes") for s in e["steps"])]
    fig, axes = plt.subplots(2 if pooled else 1, 1, figsize=(8, 7 if pooled else 4.5),
                             squeeze=False)
    ax = axes[0, 0]
    for i, eng in enumerate(_ok(record)):
        ax.plot(_steps(eng), [s["device_bytes"] / _GIB for s in eng["steps"]],
                label=run_label(eng), **_engine_style(i))
    ax.set_xlabel("step")
    ax.set_ylabel(("allocator reserved + pool" if cuda else "resident set") + ", GiB")
    ax.set_title(_title(record, "Device memory" if cuda else "Host memory (CPU run)"))
    ax.set_ylim(bottom=0)  # a flat line must look flat: no zoom onto a 4% band
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if pooled:
        ax = axes[1, 0]
        for i, eng in enumerate(pooled):
            line, = ax.plot(_steps(eng), [s["pool_bytes"] / (1 << 20) for s in eng["steps"]],
                            label=f"{run_label(eng)}: charged", **_engine_style(i))
            hw = (eng.get("pool") or {}).get("high_water_bytes")
            if hw:  # in its engine's colour: two engines' lines were the same grey
                ax.axhline(hw / (1 << 20), linestyle="--", color=line.get_color(), alpha=0.6,
                           label=f"{run_label(eng)}: high water")
        ax.set_xlabel("step")
        ax.set_ylabel("MiB (max over ranks)")
        ax.set_ylim(bottom=0)
        ax.set_title("Gather-buffer pool occupancy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, os.path.join(out_dir, "memory.png"))


def _phased(record) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(eng, eng["summary"]["compile_phases"]) for eng in _ok(record)
            if (eng.get("summary") or {}).get("compile_phases")]


def _phases_plot(record, out_dir) -> Optional[str]:
    phased = _phased(record)
    if not phased:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(phased)))
    left = [0.0] * len(phased)
    rows = list(range(len(phased)))
    longest = max(sum(p["phases"].values()) for _, p in phased) or 1.0
    for name in PHASES:
        widths = [p["phases"].get(name, 0.0) for _, p in phased]
        if max(widths) < 0.002 * longest:  # no visible width: the table lists it, the plot not
            continue
        ax.barh(rows, widths, left=left, label=PHASE_LABELS[name])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(rows, [run_label(eng) for eng, _ in phased])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (slowest rank's first step)")
    ax.set_title(_title(record, "First step by phase"))
    ax.grid(alpha=0.3, axis="x")
    # beside the bars, never over them
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, os.path.join(out_dir, "compile_phases.png"))


def phases_table(record: dict[str, Any]) -> Optional[Table]:
    """The first step by phase, one column per engine (None without phases)."""
    phased = _phased(record)
    if not phased:
        return None
    table = Table(title="first step by phase (slowest rank)")
    table.add_column("")
    for eng, p in phased:
        table.add_column(f"{run_label(eng)} (rank {p.get('rank', '?')})", justify="right")
    for name in PHASES:
        table.add_row(PHASE_LABELS[name], *[f"{p['phases'].get(name, 0.0):.2f} s"
                                            for _, p in phased])
    table.add_row("first step", *[f"{p['first_step_s']:.2f} s" for _, p in phased])
    table.add_row("time to the final plan", *[_seconds(eng["summary"].get("time_to_final_plan_s"))
                                              for eng, _ in phased])
    names = sorted({k for _, p in phased for k in p.get("zbuf_passes", {})})
    for k in names:
        table.add_row(f"  zbuf: {k}", *[f"{p.get('zbuf_passes', {}).get(k, 0.0) * 1e3:.0f} ms"
                                        for _, p in phased])
    table.add_row("first step CPU time", *[f"{p.get('cpu_s', 0.0):.1f} s" for _, p in phased])
    table.add_row("kernel compile work (CPU)",
                  *[f"{p.get('kernel_compile_work_s', 0.0):.1f} s" for _, p in phased])
    for key, label in (("fxgraph", "FX-graph cache hit/miss"), ("aot", "AOT cache hit/miss")):
        table.add_row(label, *[f"{p.get('caches', {}).get(key + '_hit', 0)} / "
                               f"{p.get('caches', {}).get(key + '_miss', 0)}" for _, p in phased])
    if any(p.get("cache_bypass_reasons") for _, p in phased):
        table.add_row("cache bypassed because",
                      *["\n".join(p.get("cache_bypass_reasons", [])) or "-" for _, p in phased])
    return table


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _compile_seconds(p: dict[str, Any]) -> float:
    """A compiling step's compile: the step less its own run (the ``first_run`` phase)."""
    return p["first_step_s"] - p["phases"].get("first_run", 0.0)


def replan_phases_table(record: dict[str, Any]) -> Optional[Table]:
    """Each re-plan that compiled, by phase, one column per engine and step, with its compile
    against the engine's cold first compile (issue 21 asks at most 20 %); None without one."""
    columns = [(eng, p, replan) for eng, p in _phased(record)
               for replan in slowest_replans(eng)]
    if not columns:
        return None
    table = Table(title="re-plan compiles by phase (slowest rank)")
    table.add_column("")
    for eng, _, r in columns:
        table.add_column(f"{run_label(eng)} step {r['step'] + 1} (rank {r['rank']})",
                         justify="right")
    for name in PHASES:
        table.add_row(PHASE_LABELS[name], *[f"{r['phases'].get(name, 0.0):.2f} s"
                                            for *_, r in columns])
    table.add_row("step (compile + run)", *[f"{r['first_step_s']:.2f} s" for *_, r in columns])
    table.add_row("compile (step less its run)",
                  *[f"{_compile_seconds(r):.2f} s" for *_, r in columns])
    table.add_row("of the first step's compile",
                  *[f"{100 * _compile_seconds(r) / _compile_seconds(first):.0f} %"
                    if _compile_seconds(first) > 0 else "-" for _, first, r in columns])
    for key, label in (("fxgraph", "FX-graph cache hit/miss"), ("aot", "AOT cache hit/miss")):
        table.add_row(label, *[f"{r.get('caches', {}).get(key + '_hit', 0)} / "
                               f"{r.get('caches', {}).get(key + '_miss', 0)}"
                               for *_, r in columns])
    return table


def _graphs(eng: dict[str, Any]) -> list[dict[str, Any]]:
    sched = eng.get("schedule")
    if isinstance(sched, dict):
        return [g for g in sched.get("graphs", []) if isinstance(g, dict)]
    return []


def _blocks(eng: dict[str, Any]) -> list[dict[str, Any]]:
    """A block frames run's runtime schedule, as a list of one (none for other runs)."""
    blocks = (eng.get("schedule") or {}).get("blocks")
    return [blocks] if isinstance(blocks, dict) else []


def _offload(blocks: dict[str, Any]) -> dict[str, Any]:
    """A block frames run's offloaded blocks (records from before them have none)."""
    return blocks.get("activation_offload") or {"blocks": []}


def _profile(g: dict[str, Any], *names: str) -> Optional[list[float]]:
    for n in names:
        v = g.get(n)
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            return v
    return None


def _schedule_plot(record, out_dir) -> Optional[str]:
    plt = _plt()
    # A block frames run's runtime schedule is drawn as a graph's: per block call
    scheduled = [(eng, g) for eng in _ok(record) for g in _graphs(eng) + _blocks(eng)]
    if not scheduled:
        return None
    profiles = [(eng, g, _profile(g, "live_gathered_profile", "live_gathered_bytes_per_node",
                                  "profile")) for eng, g in scheduled]
    if all(p is not None for _, _, p in profiles):
        fig, axes = plt.subplots(len(profiles), 1, figsize=(11, 3.2 * len(profiles)),
                                 squeeze=False)
        for ax, (eng, g, live) in zip(axes[:, 0], profiles):
            act = _profile(g, "activation_profile", "activation_bytes_per_node")
            budget = g["budget_bytes"]
            data_top = max([*live, *(act or []), 1])
            # A budget far above the data (a roomy card, the CPU default) would flatten the curves
            # to the axis: then the axis follows the data and the budget is written, not drawn.
            budget_on_scale = budget <= 4 * data_top
            top = max(data_top, budget) if budget_on_scale else data_top
            scale, unit = (_GIB, "GiB") if top >= _GIB else (float(1 << 20), "MiB")
            blocks = g.get("structure") == "blocks"
            ax.fill_between(range(len(live)), [v / scale for v in live], step="mid", alpha=0.5,
                            label="live gathered bytes" + (" (planned)" if blocks else ""))
            if act is not None:
                ax.plot(range(len(act)), [v / scale for v in act], color="tab:green",
                        label="projected activations")
            if budget_on_scale:
                ax.axhline(budget / scale, color="tab:red", linestyle="--", label="gather budget")
            else:  # a legend entry, not text on the axes: it stays off the data
                ax.plot([], [], linestyle="none", marker="^", color="tab:red",
                        label=f"gather budget {budget / _GIB:.2f} GiB (off scale)")
            if blocks:
                n = g["blocks"]
                ax.axvline(n - 0.5, color="grey", linewidth=1)
                if n <= 12:  # one tick per call while they stay readable
                    ax.set_xticks(range(2 * n), [f"fwd {i + 1}" for i in range(n)]
                                  + [f"bwd {n - i}" for i in range(n)], fontsize="small")
                ax.set_title(f"{run_label(eng)}: block frames, {g['blocks']} blocks, "
                             f"{sum(g['kept_for_backward'])} kept for backward")
                ax.set_xlabel("block call (forward, then backward)")
            else:
                last = max(h.get("plan", 0) for h in _graphs(eng))
                ax.set_title(f"{run_label(eng)}: graph {g.get('graph_id', '?')} "
                             f"({g.get('kind', '?')}), {len(live)} nodes"
                             + (", replaced by a re-plan" if g.get("plan", 0) < last else ""))
                ax.set_xlabel("graph node (execution order)")
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            # beside the axes, never over a curve (it hid the backward graph's)
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0)
    else:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        fields = [("budget_bytes", "gather budget"),
                  ("peak_live_gathered_bytes", "peak live gathered"),
                  ("activation_peak_bytes", "activation peak"),
                  ("persistent_bytes", "kept for backward")]
        width = 0.8 / len(fields)
        labels = [f"{run_label(eng)}\nblock frames" if g.get("structure") == "blocks" else
                  f"{run_label(eng)}\n{g.get('kind', '?')} #{g.get('graph_id', '?')}"
                  for eng, g in scheduled]
        for i, (key, name) in enumerate(fields):
            ax.bar([j + i * width for j in range(len(scheduled))],
                   [(g.get(key) or 0) / (1 << 20) for _, g in scheduled], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scheduled))], labels,
                      fontsize="small")
        ax.set_yscale("log")  # the budget is often orders of magnitude above the rest
        ax.set_ylabel("MiB (log scale)")
        ax.set_title(_title(record, "Gather schedule per compiled graph"))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
    return _save(fig, os.path.join(out_dir, "schedule_memory.png"))


def _with_phases(record) -> list[dict[str, Any]]:
    return [e for e in _ok(record) if "forward_peak_bytes" in e["steps"][0]]


def _rank_max(values: list) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _step_memory_plot(record, out_dir) -> Optional[str]:
    engines = _with_phases(record)
    if not engines:
        return None
    plt = _plt()
    cuda = record["environment"].get("device_type") == "cuda"
    fig, axes = plt.subplots(len(engines), 2, figsize=(13, 5.4 * len(engines)), squeeze=False)
    data_top = max([v for e in engines for s in e["steps"]
                    for k in ("forward_peak_bytes", "backward_peak_bytes",
                              "optimizer_peak_bytes", "pool_held_bytes")
                    for v in s.get(k) or [] if v is not None] + [1])
    budget_top = max([v for e in engines for s in e["steps"] for v in s.get("budget_bytes") or []
                      if v is not None] + [0])
    # A budget far above the data (a roomy card, the CPU default) would flatten the curves: the
    # axis then follows the data and the budget is written, not drawn (as in the schedule plot).
    budget_on_scale = budget_top <= 4 * data_top
    top = max(data_top, budget_top) if budget_on_scale else data_top
    scale, unit = (_GIB, "GiB") if top >= _GIB else (float(1 << 20), "MiB")
    for row, eng in enumerate(engines):
        steps = eng["steps"]
        x = _steps(eng)
        ax = axes[row, 0]
        for key, label, style, color in (
                ("forward_peak_bytes", "forward peak", "-", "tab:blue"),
                ("backward_peak_bytes", "backward peak", "-", "tab:orange"),
                ("optimizer_peak_bytes", "optimizer peak", "-", "tab:green"),
                ("pool_held_bytes", "pool held", "--", "tab:purple"),
                ("pool_idle_bytes", "pool idle", ":", "tab:brown")):
            ys = [_rank_max(s.get(key) or []) for s in steps]
            if any(y for y in ys):
                ax.plot(x, [None if y is None else y / scale for y in ys], style, marker=".",
                        color=color, label=label)
        budget = [_rank_max(s.get("budget_bytes") or []) for s in steps]
        if any(b is not None for b in budget):
            if budget_on_scale:
                ax.step(x, [None if b is None else b / scale for b in budget], where="mid",
                        color="tab:red", label="gather budget (planned, then re-planned)")
            else:
                # each in its own unit: a 5 MiB plan read "0.00 -> 20.00 GiB"
                text = " -> ".join(format_bytes(b) for b in dict.fromkeys(
                    b for b in budget if b is not None))
                # a legend entry, not text on the axes: it stays off the lines
                ax.plot([], [], linestyle="none", marker="^", color="tab:red",
                        label=f"gather budget {text} (off scale)")
            replans = [step for step, s in zip(x, steps) if any(s.get("replanned") or [])]
            for i, step in enumerate(replans):  # one legend entry for them all
                ax.axvline(step, color="tab:red", alpha=0.3, linestyle="--",
                           label=None if i else "re-plan")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{unit} (max over ranks)")
        ax.set_ylim(bottom=0)
        what = "torch allocated" if cuda else "tracked tensors (CPU stand-in)"
        ax.set_title(f"{run_label(eng)}: phase peaks ({what}) and the pool")
        ax.grid(alpha=0.3)
        # below the axes, never over the lines (it hid the pool's)
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
        ax = axes[row, 1]
        ranks = len(steps[0]["alloc_retries"])
        for r in range(ranks):
            ax.plot(x, [s["alloc_retries"][r] for s in steps], marker=".",
                    label=f"rank {r}: allocator retries (cumulative)")
        ax.set_xlabel("step")
        ax.set_ylabel("retries")
        ax.set_ylim(0, 1.15 * max([1] + [v for s in steps for v in s["alloc_retries"]]))
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        width = 0.8 / max(1, ranks)
        for r in range(ranks):
            twin.bar([step - 0.4 + (r + 0.5) * width for step in x],
                     [(s.get("pool_yielded_bytes") or [0] * ranks)[r] / scale for s in steps],
                     width, alpha=0.35, label=f"rank {r}: pool lent to the optimizer")
        twin.set_ylabel(unit)
        lines = ax.get_legend_handles_labels()
        bars = twin.get_legend_handles_labels()
        ax.legend(lines[0] + bars[0], lines[1] + bars[1], fontsize="small", loc="upper center",
                  bbox_to_anchor=(0.5, -0.15), ncol=2)  # below, as the left one: off the bars
        ax.set_title(f"{run_label(eng)}: allocator retries and pool lending, per rank")
    return _save(fig, os.path.join(out_dir, "step_memory.png"))


def _recompute_plot(record, out_dir) -> Optional[str]:
    """Per zbuf run: the activations its compiled step keeps for backward and recomputes
    (bytes), and the FLOPs backward re-runs against the forward's; the plan in force in full
    colour, each plan a re-plan replaced before it, hatched and pale (history, not a part)."""
    runs = []  # (x label, recompute stats, replaced)
    for eng in _ok(record):
        summary = eng.get("summary") or {}
        if not summary.get("recompute"):
            continue
        replaced = summary.get("recompute_replaced") or []
        for i, r in enumerate(replaced):
            runs.append((f"{run_label(eng)}\n{'measured step' if i == 0 else 're-plan ' + str(i)}"
                         "\n(replaced)", r, True))
        runs.append((run_label(eng) + ("\nfinal plan" if replaced else ""),
                     summary["recompute"], False))
    if not runs:
        return None
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6))
    names = [name for name, _, _ in runs]
    width = 0.38

    def bars(ax, key, offset, scale, label, color):
        for x, (_, r, old) in enumerate(runs):
            # the legend shows the plan in force's colours (the last bar is always one)
            ax.bar(x + offset, r[key] / scale, width, color=color, alpha=0.35 if old else 1.0,
                   hatch="//" if old else None, edgecolor=color,
                   label=label if x == len(runs) - 1 else None)

    bscale, bunit = _byte_unit(max(max(r["kept_bytes"], r["recomputed_bytes"])
                                   for _, r, _ in runs))
    bars(left, "kept_bytes", -width / 2, bscale, "kept for backward", "tab:blue")
    bars(left, "recomputed_bytes", width / 2, bscale, "recomputed in backward", "tab:orange")
    left.set_xticks(range(len(runs)), names, fontsize="small")
    left.set_ylabel(f"activations, {bunit} per rank")
    _plain_ticks(left)
    left.set_title("Activations kept and recomputed")
    left.legend(fontsize="small")
    left.grid(alpha=0.3, axis="y")
    fscale, funit = flop_unit(max(max(r["forward_flops"], r["recomputed_flops"])
                                  for _, r, _ in runs))
    bars(right, "forward_flops", -width / 2, fscale, "forward", "tab:blue")
    bars(right, "recomputed_flops", width / 2, fscale, "recomputed in backward", "tab:orange")
    right.set_xticks(range(len(runs)), [  # block counts where there are checkpointed blocks
        f"{name}\nblocks {r['regions_kept']}/{r['regions_selective']}/{r['regions_recomputed']}"
        if r.get("regions") else name for name, r, _ in runs], fontsize="small")
    right.set_ylabel(f"matmul + attention {funit} per step per rank")
    _plain_ticks(right)
    right.set_title("FLOPs" + (" (blocks kept/selective/recomputed)"
                               if any(r.get("regions") for _, r, _ in runs) else ""))
    right.legend(fontsize="small")
    right.grid(alpha=0.3, axis="y")
    for ax in (left, right):  # room above the bars for the legend, which then covers none
        ax.set_ylim(0, 1.3 * max([p.get_height() for p in ax.patches] + [1e-9]))
    fig.suptitle(_title(record, "Activation recompute"), fontsize="medium")
    return _save(fig, os.path.join(out_dir, "recompute.png"))


def make_plots(record: dict[str, Any], out_dir: str) -> list[str]:
    """Write every plot the record supports; returns the paths."""
    if not _ok(record):
        raise ValueError("the record has no engine that completed or was interrupted after a "
                         "step; nothing to plot")
    os.makedirs(out_dir, exist_ok=True)
    paths = [_loss_plot(record, out_dir), _step_time_plot(record, out_dir),
             _memory_plot(record, out_dir)]
    extra = [_phases_plot(record, out_dir), _schedule_plot(record, out_dir),
             _step_memory_plot(record, out_dir), _recompute_plot(record, out_dir)]
    return paths + [p for p in extra if p]


def _latest_decision(sm: dict[str, Any]) -> dict[str, Any]:
    """The later of the step memory's decisions that changed the plan (steady over measured)."""
    steady = sm.get("steady") or {}
    return steady if steady.get("replanned") else (sm.get("measured") or {})


def _recompiled_text(sm: dict[str, Any]) -> str:
    """Which re-plans compiled the model again ([Note: bounded re-plan] in compile/replan.py)."""
    decisions = [d for d in (sm.get("measured"), sm.get("steady")) if d and d.get("replanned")]
    if not decisions:
        return "-"
    return " / ".join("yes" if d.get("recompiled") else "no (keep-set only)" for d in decisions)


def _kept_text(e: dict[str, Any]) -> str:
    d = _latest_decision(e.get("step_memory") or {})
    if "kept_bytes" not in d:
        return "-"
    return f"{d.get('kept_weights', 0)} ({format_bytes(d['kept_bytes'])})"


def step_memory_table(record: dict[str, Any]) -> Optional[Table]:
    """The whole step's memory per engine: measured phase peaks, budgets, pool and allocator."""
    engines = _with_phases(record)
    if not engines:
        return None
    table = Table(title="step memory (max over ranks; pool events summed over ranks)")
    table.add_column("")
    for eng in engines:
        table.add_column(run_label(eng), justify="right")

    def cells(fn):
        return [fn(e) for e in engines]

    def total(key):
        return lambda e: str(sum(v or 0 for s in e["steps"] for v in s.get(key) or []))

    def peak(key, steps=slice(None)):
        return lambda e: format_bytes(_rank_max([v for s in e["steps"][steps]
                                                 for v in s.get(key) or []]))

    def measured(key):
        return lambda e: format_bytes(((e.get("step_memory") or {}).get("measured") or {})
                                      .get(key))

    def retries_after(e):  # the summary's count: record.py says which steps it covers
        after = (e.get("summary") or {}).get("alloc_retries_after_step_2_per_rank")
        return "-" if after is None else ",".join(map(str, after))

    rows = [("forward peak", peak("forward_peak_bytes", slice(1, None))),
            ("backward peak", peak("backward_peak_bytes", slice(1, None))),
            ("optimizer peak", peak("optimizer_peak_bytes", slice(1, None))),
            ("first step: forward / backward / optimizer",
             lambda e: " / ".join(format_bytes(_rank_max(e["steps"][0].get(k) or []))
                                  for k in ("forward_peak_bytes", "backward_peak_bytes",
                                            "optimizer_peak_bytes"))),
            ("measured limit (torch + pool)", measured("limit_bytes")),
            ("gather budget, planned", measured("planned_budget_bytes")),
            ("gather budget, measured", measured("budget_bytes")),
            ("re-planned at step", lambda e: ",".join(str(s["step"] + 1) for s in e["steps"]
                                              if any(s.get("replanned") or [])) or "no"),
            ("re-plan compiled", lambda e: _recompiled_text(e.get("step_memory") or {})),
            ("weights kept for backward (run time)", _kept_text),
            ("pool held, last step", peak("pool_held_bytes", slice(-1, None))),
            ("pool idle, last step", peak("pool_idle_bytes", slice(-1, None))),
            ("steps the pool lent to the optimizer",
             lambda e: str(sum(1 for s in e["steps"] if any(s.get("pool_yielded_bytes") or [])))),
            ("pool reclaims (torch cache emptied)", total("pool_reclaims")),
            ("torch out-of-memory", total("torch_ooms")),
            ("alloc retries per rank after step 2", retries_after)]
    for label, fn in rows:
        table.add_row(label, *cells(fn))
    return table


def schedule_table(record: dict[str, Any]) -> Optional[Table]:
    """Fields down, compiled graphs across (narrow terminals stay readable)."""
    graphs = [(eng, g) for eng in _ok(record) for g in _graphs(eng)]
    if not graphs:
        return None
    table = Table(title="zbuf gather schedule, one column per compiled graph")
    table.add_column("")
    for eng, g in graphs:
        # A re-plan's graphs replace the earlier plan's: those ran before it, and say so.
        last = max(h.get("plan", 0) for h in _graphs(eng))
        table.add_column(f"{run_label(eng)} {g.get('kind', '?')} #{g.get('graph_id', '?')}"
                         + (" (replaced)" if g.get("plan", 0) < last else ""), justify="right")
    rows = [("graph nodes", "num_nodes"), ("gathered parameters", "gathers"),
            ("collectives", "collectives"), ("coalesced groups", "coalesced_groups"),
            ("prefetched", "prefetched"), ("re-gathers", "regathers"),
            ("kept forward->backward", "persistent"), ("bytes kept", "persistent_bytes"),
            ("gather budget", "budget_bytes"),
            ("requested gather budget", "requested_budget_bytes"),
            ("feasible floor", "floor_bytes"), ("peak live gathered", "peak_live_gathered_bytes"),
            ("activation peak", "activation_peak_bytes"),
            ("modelled compute", "modelled_compute_seconds"),
            ("modelled exposed gathers", "modelled_exposed_seconds"),
            ("planning time", "planning_seconds"), ("fingerprint", "fingerprint")]
    # What the forward/backward pair kept and recomputed (compile/recompute.py; the same in both
    # graphs of a pair), for records that carry it.
    if any(g.get("recompute") for _, g in graphs):
        rows += [("recompute mode", "recompute.mode"),
                 ("blocks recomputed", "recompute.regions_recomputed"),
                 ("blocks selective", "recompute.regions_selective"),
                 ("blocks kept", "recompute.regions_kept"),
                 ("activation budget", "recompute.activation_budget_bytes"),
                 ("activation peak (pair)", "recompute.activation_peak_bytes"),
                 ("activations kept", "recompute.kept_bytes"),
                 ("activations recomputed", "recompute.recomputed_bytes"),
                 ("forward FLOPs", "recompute.forward_flops"),
                 ("recomputed FLOPs", "recompute.recomputed_flops")]
    scale, unit = flop_unit(max([(g.get("recompute") or {}).get("forward_flops") or 0
                                 for _, g in graphs]))
    for label, key in rows:
        cells = []
        for _, g in graphs:
            v = g.get(key)
            if key.startswith("recompute."):
                v = (g.get("recompute") or {}).get(key.split(".", 1)[1])
                if key.endswith("activation_budget_bytes") and v == 0:
                    v = None  # only "auto" plans against a budget
            if v is None:
                cells.append("-")
            elif key.endswith("_bytes"):
                cells.append(format_bytes(v))
            elif key.endswith("_flops"):
                cells.append(f"{v / scale:,.2f} {unit}")
            elif key.endswith("_seconds"):
                cells.append(f"{v * 1e3:.1f} ms")
            else:
                cells.append(str(v))
        table.add_row(label, *cells)
    return table


def block_schedule_table(record: dict[str, Any]) -> Optional[Table]:
    """A block frames run's runtime schedule ([Note: one Dynamo frame per block] in
    zbuf/compile/block_frames.py), one column per engine; None without one."""
    runs = [(eng, b) for eng in _ok(record) for b in _blocks(eng)]
    if not runs:
        return None
    table = Table(title="zbuf block frames: the runtime gather schedule")
    table.add_column("")
    for eng, _ in runs:
        table.add_column(run_label(eng), justify="right")

    def levels(b):
        if b.get("recompute") != "auto":  # no level chosen; the offloaded blocks have rows
            return {"none": "all kept"}.get(b.get("recompute"), "as the model checkpoints")
        return "/".join(str(b["levels"].count(name)) for name in ("keep", "selective",
                                                                   "recompute"))

    rows = [("blocks", lambda b: str(b["blocks"])),
            ("one block's weights", lambda b: format_bytes(b["block_bytes"])),
            ("parameters outside the blocks", lambda b: format_bytes(b["outer_bytes"])),
            ("gathered one block ahead", lambda b: "yes" if b["prefetch"] else "no"),
            ("gather budget", lambda b: format_bytes(b["budget_bytes"])),
            ("peak live gathered (planned)",
             lambda b: format_bytes(b["peak_live_gathered_bytes"])),
            ("pool budget", lambda b: format_bytes(b["pool_bytes"])),
            ("blocks kept/selective/recomputed", levels),
            ("blocks kept for backward", lambda b: str(sum(b["kept_for_backward"]))),
            ("frames compiled", lambda b: str(b["frames_compiled"]))]
    if any(_offload(b)["blocks"] for _, b in runs):
        # [Note: offloaded blocks] in zbuf/compile/block_offload.py
        def per_step(b, key):
            o = _offload(b)
            return o[key] / o["forwards"] if o.get("forwards") else None

        rows += [("of the kept, offloaded to host", lambda b: str(len(_offload(b)["blocks"]))),
                 ("to host and back per step", lambda b: format_bytes(
                     per_step(b, "moved_down_bytes"))),
                 ("copies exposed per step", lambda b: (
                     "-" if _offload(b).get("exposed_ms_per_step") is None
                     else f"{_offload(b)['exposed_ms_per_step']:.1f} ms")),
                 ("uploads started late", lambda b: str(_offload(b).get("late_uploads", 0))),
                 ("host memory page-locked", lambda b: _locked(_offload(b)))]
    for label, fn in rows:
        table.add_row(label, *[fn(b) for _, b in runs])
    return table


def _locked(offload: dict) -> str:
    """The offloaded blocks' host arenas, the wall time their locking took on its own thread,
    and what the forward copied through pageable memory meanwhile ([Note: host arenas and the
    first offloaded step] in zbuf/compile/block_offload.py), with the Python thread's wait for
    those copies where the record has it; records made before the arenas have none, and those
    before the forward stopped waiting for them the time it waited."""
    if "host_arena_bytes" not in offload:
        return "-"
    locked = f"{format_bytes(offload['host_arena_bytes'])} in {offload['lock_seconds']:.1f} s"
    if "pin_wait_seconds" in offload:
        return f"{locked}, waited {offload['pin_wait_seconds']:.1f} s"
    copied = f"{locked}, {format_bytes(offload['unlocked_host_bytes'])} copied before"
    if "unlocked_copy_seconds" in offload:
        copied += f" (the thread held {offload['unlocked_copy_seconds']:.1f} s)"
    return copied


def main(path: str, out_dir: Optional[str] = None) -> int:
    try:
        record = load_record(path)
    except FileNotFoundError:
        print_error("report", f"no such file: {path}")
        return 2
    except ValueError as e:
        print_error("report", str(e))
        return 2
    except OSError as e:  # read, not written: it is the record that cannot be read
        print_error("report", f"cannot read {path}: {e.strerror}")
        return 2
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(path)),
                                      os.path.splitext(os.path.basename(path))[0] + "-report")
    try:
        paths = make_plots(record, out_dir)
    except ValueError as e:
        print_error("report", str(e))
        return 2
    except (KeyError, TypeError, IndexError) as e:  # a record with parts missing or mangled
        print_error("report", f"{path} is not a complete zbuf run record ({type(e).__name__}: "
                              f"{e}); write it again with zbuf train --out or zbuf bench --out")
        return 2
    except OSError as e:
        print_error("report", f"cannot write plots to {out_dir}: {e.strerror}")
        return 2
    console = Console()
    sim = simulated_text(record)
    if sim:
        console.print(sim, highlight=False, markup=False, soft_wrap=True)
    phases = phases_table(record)
    if phases is not None:
        print_table(console, phases)
    replans = replan_phases_table(record)
    if replans is not None:
        print_table(console, replans)
    schedules = [t for t in (schedule_table(record), block_schedule_table(record)) if t]
    for table in schedules:
        print_table(console, table)
    if not schedules:
        console.print("no zbuf schedule in this record (engines without the zbuf compiler)")
    memory = step_memory_table(record)
    if memory is not None:
        print_table(console, memory)
    for p in paths:
        console.print(f"wrote {p}", highlight=False, soft_wrap=True)  # a path, whole
    return 0
