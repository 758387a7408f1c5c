"""The reference configuration's table (issue 19) from ``zbuf bench`` records, one row per run.

    python3 benches/reference_table.py benches/results/seed14.json [MORE.json ...] [--out T.md]

Columns: median step and its min-max over the measured steps, MFU, allocator retries per rank in
warm-up and in the measured steps, rank 0's peak reserved (torch's caching allocator, the largest
phase peak of any step) and peak device-used memory (reserved + the zbuf pool's high water: what
the card must hold), the first step, and, for a simulated run, the communication estimate per
step at the record's link bandwidth (never part of the step time; [Note: simulated ranks] in
zbuf/train/simulate.py), and the optimizer state a zbuf run kept in host memory (by the user or
the plan; bytes moved and exposed per step). Every row of a simulated record is marked as such.
"""

from __future__ import annotations

import argparse
import re
import sys

from zbuf.train.config import format_bytes
from zbuf.train.record import hardware_text, load_record, run_label, simulated_text


_OOM = re.compile(r"OutOfMemoryError: CUDA out of memory\. Tried to allocate ([\d.]+ \w+)\..*?"
                  r"([\d.]+ \w+) allowed; Of the allocated memory ([\d.]+ \w+) is allocated")


def _failure(eng: dict) -> str:
    """One cell's worth of why a run failed: a CUDA OOM as its request and the allocator's state,
    anything else as the error's last line."""
    lines = (eng.get("error") or "").strip().splitlines()
    last = lines[-1] if lines else ""
    oom = _OOM.search(last)
    if oom:
        return (f"CUDA out of memory: asked {oom.group(1)} with {oom.group(3)} allocated of "
                f"{oom.group(2)} allowed")
    return last[:200].replace("|", "/")


def _label(record: dict, eng: dict) -> str:
    """The run's name, with its activation checkpointing where it is not the record's."""
    label = run_label(eng)
    ac = eng.get("ac")
    if ac and ac != record["config"].get("ac") and ":" not in label:
        label = f"{label}:{ac}"
    return label + (" (simulated)" if record.get("simulated") else "")


def _offload_text(summary: dict) -> str:
    """The optimizer's state moved to host memory, by whom, and what moving it cost a step
    ([Note: offloading when the step does not fit] in zbuf/offload_choice.py)."""
    off = (summary.get("step_memory") or {}).get("optimizer_offload") or {}
    if not off.get("active"):
        return "-"
    moved = off.get("bytes_moved_per_step")
    cost = ("" if moved is None else
            f"; {format_bytes(moved)} moved, {off['exposed_ms_median']:.0f} ms exposed per step")
    return f"{format_bytes(off['offloaded_state_bytes'])} by the {off['chosen_by']}{cost}"


def _rows(record: dict) -> list[str]:
    out = []
    for eng in record["engines"]:
        if eng.get("status") != "ok":
            out.append(f"| {_label(record, eng)} | {eng.get('status')}: {_failure(eng)} "
                       f"| | | | | | | | |")
            continue
        s = eng["summary"]
        ranks = eng["per_rank"]
        warm = ",".join(str(r["alloc_retries_total"] - r["alloc_retries_measured"]) for r in ranks)
        measured = ",".join(str(r["alloc_retries_measured"]) for r in ranks)
        reserved = max(max(step["reserved_peak_bytes"]) for step in eng["steps"])
        comm = eng.get("communication")
        comm_text = "-" if not comm else (
            f"{comm['seconds'] * 1e3:.3g} ms ({format_bytes(comm['wire_bytes'])} per rank at "
            f"{comm['link_gbps']:g} Gbit/s)")
        mfu = "-" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"
        out.append(
            f"| {_label(record, eng)} | "
            f"{s['step_time_median_s'] * 1e3:,.0f} ms | {s['step_time_min_s'] * 1e3:,.0f}-"
            f"{s['step_time_max_s'] * 1e3:,.0f} ms | {mfu} | {warm} / {measured} | "
            f"{format_bytes(reserved)} | {format_bytes(s['peak_device_bytes'])} | "
            f"{s['first_step_s']:.1f} s | {comm_text} | {_offload_text(s)} |")
    return out


def table(records: list[dict]) -> str:
    first = records[0]
    cfg, env = first["config"], first["environment"]
    card = cfg.get("gpu_memory")
    head = (f"## {first['model']['name']}: micro-batch {cfg['micro_batch']} x seq "
            f"{cfg['seq_len']}, {first['world_size']} ranks, AC {cfg['ac']}, {cfg['dtype']}"
            + (f", card {format_bytes(card)}" if card else "")
            + f"; {cfg['warmup']} warm-up + {cfg['steps'] - cfg['warmup']} measured steps")
    lines = [head, "", f"Hardware: {hardware_text(env)}; torch {env.get('torch')}; zbuf "
                       f"{env.get('zbuf_commit') or '?'}.", ""]
    for r in records:
        text = simulated_text(r)
        if text:
            lines += [f"**{text}**", ""]
            break
    lines += ["| engine | step, median | min-max | MFU | retries per rank: warm-up / measured | "
              "peak reserved (rank 0) | peak device-used | first step | communication estimate "
              "| optimizer state in host memory |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in records:
        lines += _rows(r)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", metavar="RUN.json")
    p.add_argument("--out", help="write the table here too")
    args = p.parse_args(argv)
    try:
        records = [load_record(path) for path in args.records]
    except (OSError, ValueError) as e:
        print(f"reference_table: error: {e}", file=sys.stderr)
        return 2
    text = table(records)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
