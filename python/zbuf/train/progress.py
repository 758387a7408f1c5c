"""What the user watches: a live rich progress bar on rank 0, then a summary table.

On a terminal the bar shows step, loss, tokens/s and memory; when stdout is not a terminal (CI
logs, pipes) it prints a plain line every tenth of the run instead, so logs stay readable.

The loss shown live is the one the record and the summary hold: the step's mean over ranks
([Note: step timing] in ``loop``), labelled so.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .config import Engine, format_bytes
from .errors import print_error  # noqa: F401 - re-exported: the callers' name for it
from .record import per_device_words, ranks_text, run_label

__all__ = ["NullProgress", "TrainProgress", "summary_table", "comparison_table", "print_error",
           "print_table", "flop_unit"]


class NullProgress:
    """Ranks other than 0 report nothing."""

    def start_engine(self, name: str, total: int, start: int = 0) -> None:
        pass

    def step(self, step: int, loss: float, tokens_per_s: float, device_bytes: int) -> None:
        pass

    def notice(self, text: str) -> None:
        pass

    def end_engine(self) -> None:
        pass


class TrainProgress(NullProgress):
    def __init__(self, console: Optional[Console] = None, memory_label: str = "mem") -> None:
        self.console = console or Console()
        self.memory_label = memory_label
        self._progress: Optional[Progress] = None
        self._task = None
        self._name = ""
        self._total = 0

    def start_engine(self, name: str, total: int, start: int = 0) -> None:
        self._name, self._total = name, total
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("mean loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[mem]}"), TimeElapsedColumn(), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(name, total=total, completed=start, loss="-",
                                                 tps="-", mem="-")
        else:
            resumed = f" (resuming after step {start})" if start else ""
            self.console.print(f"[{name}] training {total} steps{resumed}; loss: the mean over "
                               f"ranks", markup=False)

    def step(self, step: int, loss: float, tokens_per_s: float, device_bytes: int) -> None:
        """``loss``: the step's mean over ranks."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, loss=f"{loss:.4f}",
                                  tps=f"{tokens_per_s:,.0f}",
                                  mem=f"{self.memory_label} {format_bytes(device_bytes)}")
            return
        every = max(1, self._total // 10)
        if step % every == 0 or step == self._total - 1:
            self.console.print(
                f"[{self._name}] step {step + 1}/{self._total}  mean loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  {self.memory_label} {format_bytes(device_bytes)}",
                highlight=False, markup=False)

    def notice(self, text: str) -> None:
        """Something the user must know about the run as it starts (e.g. a raised budget)."""
        self.console.print(f"[{self._name}] note: {text}", highlight=False, markup=False,
                           soft_wrap=True)

    def end_engine(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(record: dict[str, Any]) -> Table:
    """Metrics down, engines across: fits a narrow terminal and compares side by side."""
    cuda = record["environment"].get("device_type") == "cuda"
    cfg = record["config"]
    engines = record["engines"]
    summaries = [e["summary"] for e in engines if e.get("summary")]
    measured = {s["measured_steps"] for s in summaries} or {cfg["steps"] - cfg["warmup"]}
    starts = {s.get("start_step", 0) for s in summaries} - {0}
    counts = sorted(measured)
    title = (f"zbuf {record['command']}: {record['model']['name']}, "
             f"{ranks_text(record['world_size'])}, {cfg['micro_batch']} x {cfg['seq_len']} "
             f"tokens/rank, {'/'.join(map(str, counts))} measured "
             f"step{'' if counts == [1] else 's'}"
             + (f", resumed at step {min(starts)}" if starts else "")
             + (" (SIMULATED ranks)" if record.get("simulated") else ""))
    # As wide as its title where the terminal allows: a title wraps to its table's width, and
    # a narrow table split it mid-phrase ("27" / "measured steps") at 80 and 160 columns.
    table = Table(title=title, min_width=len(title))
    table.add_column("")
    for eng in engines:
        table.add_column(run_label(eng), justify="right")

    def row(label: str, fn) -> None:
        cells = []
        for eng in engines:
            s = eng.get("summary")
            if label == "status":
                cells.append({"ok": "[green]ok[/green]", "interrupted": "[yellow]interrupted"
                              "[/yellow]"}.get(eng["status"], f"[red]{eng['status']}[/red]"))
            elif s is None:
                cells.append("-")
            else:
                cells.append(fn(s))
        table.add_row(label, *cells)

    row("status", None)
    row("step time, median", lambda s: f"{s['step_time_median_s'] * 1e3:,.1f} ms")
    row("step time, min-max", lambda s: f"{s['step_time_min_s'] * 1e3:,.1f}-"
                                        f"{s['step_time_max_s'] * 1e3:,.1f} ms")
    row("tokens/s per " + ("GPU" if cuda else "rank"),
        lambda s: f"{s['tokens_per_s_per_gpu']:,.0f}")
    row("MFU", lambda s: "-" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%")
    row("peak device memory" if cuda else "peak RSS",
        lambda s: format_bytes(s["peak_device_bytes"]))
    row("alloc retries per rank", lambda s: ",".join(map(str, s["alloc_retries_per_rank"])))
    compiles = all(Engine(e["engine"]).compiles for e in engines)
    row("first step (compile)" if compiles else "first step",
        lambda s: f"{s['first_step_s']:.2f} s")
    row("time to the final plan", lambda s: "-" if s.get("time_to_final_plan_s") is None
        else f"{s['time_to_final_plan_s']:.2f} s")
    row("loss (mean over ranks)", lambda s: f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}")
    row("pool hits / misses", lambda s: f"{s['pool'].get('hits', 0)} / "
                                        f"{s['pool'].get('misses', 0)}" if s.get("pool") else "-")
    row("pool high water", lambda s: format_bytes(s["pool"].get("high_water_bytes"))
        if s.get("pool") else "-")
    def offload(s):  # [Note: offloading when the step does not fit] in zbuf/offload_choice.py
        return (s.get("step_memory") or {}).get("optimizer_offload") or {}

    if any(offload(s).get("active") for s in summaries):
        row("optimizer state offloaded", lambda s: "-" if not offload(s).get("active") else
            f"{format_bytes(offload(s)['offloaded_state_bytes'])} (by the "
            f"{offload(s)['chosen_by']})")
        row("offload moved / exposed per step", lambda s: "-" if not offload(s).get("active")
            or offload(s).get("bytes_moved_per_step") is None else
            f"{format_bytes(offload(s)['bytes_moved_per_step'])} / "
            f"{offload(s)['exposed_ms_median']:.1f} ms")
        row("offload window", lambda s: _window(offload(s)))
    row("schedule budget", lambda s: format_bytes(s.get("schedule_budget_bytes")))
    row("peak live gathered", lambda s: format_bytes(s.get("schedule_peak_live_bytes")))
    # Recompute rows say what is true of the mode: without checkpointed blocks (--ac off) the
    # step recomputes nothing a user chose, so only what forward kept for backward is shown (the
    # partitioner's own FLOP-free recomputes of views and casts are not "recomputed").
    checkpointed = any(s.get("recompute") and s["recompute"]["regions"] for s in summaries)
    if checkpointed:
        # The plan in force; the plans a re-plan replaced are history, shown apart (adding them
        # up read "4/0/4 blocks" for a 4-block model that kept all 4).
        scale, unit = flop_unit(max(s["recompute"]["forward_flops"] for s in summaries
                                    if s.get("recompute")))

        def levels(r):
            return "/".join(str(r[k]) for k in ("regions_kept", "regions_selective",
                                                 "regions_recomputed"))

        def activations(r):
            return f"{format_bytes(r['kept_bytes'])} / {format_bytes(r['recomputed_bytes'])}"

        row("blocks kept/selective/recomputed",
            lambda s: levels(s["recompute"]) if s.get("recompute") else "-")
        if any((s.get("recompute") or {}).get("regions_offloaded") for s in summaries):
            # Of the kept blocks, those whose activations wait in host memory ([Note: offloaded
            # blocks] in zbuf/compile/block_offload.py).
            row("of them offloaded to host",
                lambda s: str(s["recompute"].get("regions_offloaded", 0))
                if s.get("recompute") else "-")
        row("activations kept / recomputed",
            lambda s: activations(s["recompute"]) if s.get("recompute") else "-")
        row(f"recomputed {unit} per step", lambda s: (
            f"{s['recompute']['recomputed_flops'] / scale:,.2f} of "
            f"{s['recompute']['forward_flops'] / scale:,.2f}") if s.get("recompute") else "-")
        if any(s.get("recompute_replaced") for s in summaries):
            row("before the re-plan: blocks", lambda s: " -> ".join(
                levels(r) for r in s.get("recompute_replaced") or []) or "-")
            row("before the re-plan: kept / recomputed", lambda s: " -> ".join(
                activations(r) for r in s.get("recompute_replaced") or []) or "-")
    elif any(s.get("recompute") for s in summaries):
        row("activations kept for backward", lambda s: format_bytes(
            s["recompute"]["kept_bytes"]) if s.get("recompute") else "-")
    return table


_LABEL_WIDTH = 20
"""The narrowest a table's label column is made (its labels wrap at words) before its value
columns are split over several tables."""


def print_table(console: Console, table: Table) -> None:
    """Print a table of labels (its first column) and values (the others) with every value
    whole: a value never wraps and is never cut (a fingerprint read "13494faf321…" at 80
    columns). When the value columns do not fit beside labels of ``_LABEL_WIDTH``, the table is
    printed as several, each with the labels and as many value columns as fit."""
    labels, values = table.columns[0], table.columns[1:]

    def width(column) -> int:
        cells = [Text.from_markup(c).cell_len if isinstance(c, str) else Text(str(c)).cell_len
                 for c in column._cells]
        return max(cells + [Text(str(column.header)).cell_len])  # no_wrap holds the header too

    for column in values:
        column.no_wrap = True
    room = console.width - 1 - (_LABEL_WIDTH + 3)  # the left border; the labels, padded
    parts: list[list] = [[]]
    used = 0
    for column in values:
        need = width(column) + 3  # padding both sides and its right border
        if parts[-1] and used + need > room:
            parts.append([])
            used = 0
        parts[-1].append(column)
        used += need
    if len(parts) == 1:
        console.print(table)
        return
    for i, part in enumerate(parts):
        title = table.title if i == 0 else f"{table.title} (continued)"
        piece = Table(title=title)
        piece.add_column(labels.header, justify=labels.justify)
        for column in part:
            piece.add_column(column.header, justify=column.justify, no_wrap=True)
        for row in range(len(labels._cells)):
            piece.add_row(labels._cells[row], *[c._cells[row] for c in part])
        console.print(piece)


def flop_unit(top: float) -> tuple[float, str]:
    """(scale, name) of the decimal unit that shows ``top`` FLOP as a number >= 1: a table or
    plot shows all its FLOP counts in the unit of its largest (one format per table)."""
    for scale, name in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if top >= scale:
            return scale, name
    return 1.0, "FLOP"


def comparison_table(record: dict[str, Any]) -> Optional[Table]:
    """Ratios against a baseline engine (fsdp2 when present, else the first that ran)."""
    ok = [e for e in record["engines"] if e["status"] == "ok"]
    if len(ok) < 2:
        return None
    # FSDP2 with full activation checkpointing when it ran, else the first FSDP2 run.
    fsdp2 = [e for e in ok if e["engine"] == "fsdp2"]
    base = next((e for e in fsdp2 if e.get("ac") in ("full", None)), fsdp2[0] if fsdp2 else ok[0])
    b = base["summary"]
    unit, memory = per_device_words(record)
    table = Table(title=f"relative to {run_label(base)} (lower is better for time and memory)")
    for col in ("engine", "step time", f"tok/s/{unit}", memory, "first step",
                "to the final plan"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for eng in ok:
        s = eng["summary"]
        table.add_row(run_label(eng),
                      f"{s['step_time_median_s'] / b['step_time_median_s']:.3f}x",
                      f"{s['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.3f}x",
                      f"{s['peak_device_bytes'] / max(b['peak_device_bytes'], 1):.3f}x",
                      f"{s['first_step_s'] / b['first_step_s']:.3f}x",
                      # Against the baseline's own time to its final plan (its set-up and
                      # first step: FSDP2 never re-plans), so the baseline reads 1.000x as in
                      # every other column (against its first step alone it read 1.190x).
                      "-" if s.get("time_to_final_plan_s") is None
                      or not b.get("time_to_final_plan_s")
                      else f"{s['time_to_final_plan_s'] / b['time_to_final_plan_s']:.3f}x")
    return table


def _window(offload: dict) -> str:
    """[Note: the step's window] in zbuf/offload_window.py, in a table cell."""
    w = offload.get("window")
    if w is None:
        return offload.get("window_off") or ("none fits" if offload.get("window_sized_from")
                                             else "-")
    up, back = w["uploads"], w["releases"]
    return (f"{len(up)} slots, up from backward point {up[0]} to {up[-1]}, back from forward "
            f"point {back[0]} to {back[-1]}")
