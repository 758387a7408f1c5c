"""The first step by phase across several ``zbuf train`` records, as one table (issue 14).

    python3 benches/compile_phases.py --out benches/results/compile_phases_cpu \\
        "whole graph, 4 layers=before_L4.json" "blocks, 4 layers=after_L4.json" ...

Each argument is ``LABEL=RECORD``; the record's zbuf engine is read (the slowest rank's phases,
[Note: compile phases] in zbuf/train/compile_phases.py). Writes ``OUT.md`` (versions and
hardware in the header, one column per record) and ``OUT.json`` (the phases of every rank of
every record, and what the table shows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from zbuf.train.compile_phases import PHASE_LABELS, PHASES  # noqa: E402
from zbuf.train.config import format_bytes  # noqa: E402
from zbuf.train.record import ac_text, hardware_text, load_record  # noqa: E402


def _engine(record: dict) -> dict | None:
    for eng in record["engines"]:
        if eng["engine"] == "zbuf" and eng.get("status") == "ok":
            return eng
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("runs", nargs="+", metavar="LABEL=RECORD")
    args = p.parse_args(argv)
    cols = []
    for item in args.runs:
        label, _, path = item.rpartition("=")
        if not label:
            raise SystemExit(f"{item!r}: expected LABEL=RECORD")
        try:
            rec = load_record(path)
        except (OSError, ValueError) as e:  # a run that did not finish: table the others
            print(f"skipped {label}: {e}", file=sys.stderr)
            continue
        eng = _engine(rec)
        if eng is None:
            print(f"skipped {label}: no completed zbuf engine in {path}", file=sys.stderr)
            continue
        cols.append((label, path, rec, eng))
    if not cols:
        raise SystemExit("no record to table")
    _, _, first, _ = cols[0]
    env, cfg = first["environment"], first["config"]
    hw = hardware_text(env)
    lines = [
        f"## First step by phase: {first['model']['name']}, micro-batch {cfg['micro_batch']} x "
        f"seq {cfg['seq_len']}, {first['world_size']} rank(s), {cfg['compiler']}, "
        f"AC {ac_text(cfg)}, {cfg['dtype']}",
        "",
        f"Hardware: {hw} ({env.get('hostname')}). torch {env.get('torch')}, CUDA "
        f"{env.get('cuda') or '-'}; zbuf {env.get('zbuf_commit') or '?'}. Seconds, the slowest "
        "rank's first step; phases as in [Note: compile phases] (zbuf/train/compile_phases.py).",
        "",
        "| phase | " + " | ".join(c[0] for c in cols) + " |",
        "| --- |" + " ---: |" * len(cols),
    ]
    ph = [c[3]["summary"]["compile_phases"] for c in cols]
    for name in PHASES:
        lines.append(f"| {PHASE_LABELS[name]} | "
                     + " | ".join(f"{x['phases'][name]:.1f}" for x in ph) + " |")
    lines.append("| **first step** | " + " | ".join(f"**{x['first_step_s']:.1f}**" for x in ph)
                 + " |")
    lines.append("| compile (first step less first run) | " + " | ".join(
        f"{x['first_step_s'] - x['phases']['first_run']:.1f}" for x in ph) + " |")
    lines.append("| first step CPU time, all ranks (s) | " + " | ".join(
        f"{sum(r.get('cpu_s', 0.0) for r in c[3]['compile_phases']):.1f}" for c in cols) + " |")
    for key, label in (("fxgraph", "FX-graph cache hit / miss"), ("aot", "AOT cache hit / miss")):
        lines.append(f"| {label} | " + " | ".join(
            f"{x['caches'].get(key + '_hit', 0)} / {x['caches'].get(key + '_miss', 0)}"
            for x in ph) + " |")
    lines.append("| step time, median (s) | " + " | ".join(
        f"{c[3]['summary']['step_time_median_s']:.3f}" for c in cols) + " |")
    lines.append("| peak memory | " + " | ".join(
        format_bytes(c[3]["summary"]["peak_device_bytes"]) for c in cols) + " |")
    lines.append("| final loss | " + " | ".join(
        f"{c[3]['summary']['final_loss']:.4f}" for c in cols) + " |")
    lines.append("| compile_structure | " + " | ".join(
        str(c[2]["config"].get("compile_structure")) for c in cols) + " |")
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"environment": env, "config": cfg, "model": first["model"],
                   "runs": [{"label": c[0], "record": os.path.basename(c[1]),
                             "config": c[2]["config"], "compile_phases": c[3]["compile_phases"],
                             "summary": {k: c[3]["summary"][k] for k in (
                                 "first_step_s", "step_time_median_s", "peak_device_bytes",
                                 "final_loss", "compile_phases")}}
                            for c in cols]}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
