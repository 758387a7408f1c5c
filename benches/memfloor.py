"""Memory floor: the lowest ``--mem-frac`` at which an engine completes its steps (issue 12).

Runs ``zbuf bench`` once per (engine, fraction), one engine per invocation (so no engine's
leftovers share a process with another's), from the highest fraction down, and stops an
engine's sweep at its first failure. Every run writes its own record; a summary (JSON +
markdown) says per engine and optimizer which fractions completed, the median step, the peak
device memory, the allocator retries per rank after the first two steps, and for zbuf whether
it re-planned and how often the pool lent its blocks to the optimizer step.

    python benches/memfloor.py --engines zbuf,fsdp2 --fracs 0.60,0.55 --optimizer adamw \\
        --out-dir /tmp/out -- --preset qwen3-8b --micro-batch 4 --seq-len 4096 --ac
    python benches/memfloor.py --summarize /tmp/out1 /tmp/out2 --out benches/results/memfloor_8b

Issue 20's floors (one H200; ``--simulate-world``/``--gpu-memory`` pass through to
``zbuf bench`` once the CLI has them):

    python benches/memfloor.py --engines zbuf,fsdp2 --optimizer adamw,adamw-fused \
        --fracs 0.45,0.40,0.35,0.30,0.25,0.20,0.15 --out-dir $OUT/1p7b -- \
        --preset qwen3-1.7b --micro-batch 4 --seq-len 4096 --ac
    python benches/memfloor.py --engines zbuf,fsdp2 --optimizer adamw,adamw-fused \
        --fracs 0.70,0.65,0.60,0.55,0.50,0.45,0.40 --out-dir $OUT/8b_w2 -- \
        --preset qwen3-8b --simulate-world 2 --micro-batch 4 --seq-len 4096 --ac

Arguments after ``--`` go to every ``zbuf bench``. ``--time-limit`` (seconds) skips runs that
would not finish inside it (the device tool's 10-minute command limit), judged from the
engine's previous run in this sweep; skipped fractions are reported as such, not as failures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

_NAME = re.compile(r"memfloor_(?P<engine>[a-z0-9-]+)_(?P<opt>[a-z-]+)_(?P<frac>[0-9.]+)\.json$")


def _run(engine: str, frac: float, optimizer: str, out_dir: str, bench_args: list[str],
         timeout: float) -> str:
    out = os.path.join(out_dir, f"memfloor_{engine}_{optimizer}_{frac:.2f}.json")
    cmd = [sys.executable, "-m", "zbuf.cli", "bench", "--engines", engine, "--mem-frac",
           f"{frac:.2f}", "--optimizer", optimizer, "--no-progress", *bench_args, "--out", out]
    log = out[:-5] + ".log"
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\n[memfloor] timed out after {timeout:.0f} s\n")
    return out


def _row(path: str) -> dict:
    """One run's line of the table, from its record (or its log when it left none)."""
    m = _NAME.search(path)
    row = {"engine": m["engine"], "optimizer": m["opt"], "mem_frac": float(m["frac"]),
           "record": os.path.basename(path)}
    try:
        with open(path) as f:
            eng = json.load(f)["engines"][0]
    except (OSError, ValueError, KeyError, IndexError):
        log = path[:-5] + ".log"
        tail = open(log).read().strip().splitlines()[-1:] if os.path.exists(log) else []
        return dict(row, status="failed", error=(tail or ["no record"])[0][:200])
    if eng.get("status") != "ok":
        lines = (eng.get("error") or "").strip().splitlines()
        # zbuf's refusal of a plan or step that cannot fit names memory too; it is not an OOM.
        refused = any("PlanExceedsMemoryError" in ln for ln in lines)
        oom = any("out of memory" in ln.lower() or "OutOfMemory" in ln for ln in lines)
        status = "refused" if refused else "oom" if oom else "failed"
        # The line that names the error, not torch's "set TORCHDYNAMO_VERBOSE" trailer.
        named = [ln for ln in lines if "Error" in ln] or lines or [""]
        return dict(row, status=status, error=named[-1][:200])
    s = eng["summary"]
    steps = eng["steps"]
    sm = s.get("step_memory") or {}
    return dict(
        row, status="ok", steps=len(steps),
        step_median_s=s["step_time_median_s"],
        peak_device_bytes=s["peak_device_bytes"],
        alloc_retries_after_step_2=s.get("alloc_retries_after_step_2_per_rank"),
        replanned=sm.get("replanned"), pool_lent_steps=sm.get("pool_yields"),
        losses=[st["loss"] for st in steps])


def summarize(dirs: list[str]) -> dict:
    # Every run leaves a log; a run that died before writing its record left only that.
    runs = {p[:-4] + ".json" for d in dirs for p in glob.glob(os.path.join(d, "memfloor_*.log"))}
    rows = sorted((_row(p) for p in runs if _NAME.search(p)),
                  key=lambda r: (r["engine"], r["optimizer"], -r["mem_frac"]))
    floors = {}
    for r in rows:
        key = f"{r['engine']}/{r['optimizer']}"
        if r["status"] == "ok":
            floors[key] = min(floors.get(key, 2.0), r["mem_frac"])
    return {"runs": rows, "floors": floors}


def markdown(summary: dict) -> str:
    lines = ["| engine | optimizer | --mem-frac | status | median step | peak device | "
             "retries/rank after step 2 | re-planned | pool lent (steps) |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | --- | ---: |"]
    for r in summary["runs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['engine']} | {r['optimizer']} | {r['mem_frac']:.2f} | "
                         f"**{r['status']}**: {r.get('error', '').replace('|', '/')} | | | | | |")
            continue
        retries = ",".join(map(str, r["alloc_retries_after_step_2"] or [])) or "-"
        lines.append(
            f"| {r['engine']} | {r['optimizer']} | {r['mem_frac']:.2f} | ok ({r['steps']} steps) | "
            f"{1e3 * r['step_median_s']:.0f} ms | {r['peak_device_bytes'] / 2**30:.1f} GiB | "
            f"{retries} | {r['replanned'] if r['replanned'] is not None else '-'} | "
            f"{r['pool_lent_steps'] if r['pool_lent_steps'] is not None else '-'} |")
    lines.append("")
    lines.append("Floors (lowest fraction completed): " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(summary["floors"].items())))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="zbuf,fsdp2")
    p.add_argument("--optimizer", default="adamw",
                   help="one optimizer or several, comma-separated (adamw,adamw-fused): each "
                        "sweeps the fractions on its own")
    p.add_argument("--fracs", default="0.70,0.65,0.60,0.55,0.50,0.45,0.40",
                   help="fractions, highest first")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--time-limit", type=float, default=None)
    p.add_argument("--run-timeout", type=float, default=580)
    p.add_argument("--summarize", nargs="+", metavar="DIR")
    p.add_argument("--out", help="summary path without extension (default OUT_DIR/memfloor)")
    args = p.parse_args(argv)
    if args.summarize:
        dirs = args.summarize
    else:
        start = time.monotonic()
        fracs = sorted((float(f) for f in args.fracs.split(",")), reverse=True)
        engines = args.engines.split(",")
        last: dict[tuple[str, str], float] = {}  # (engine, optimizer) -> its previous run's s
        done: set[tuple[str, str]] = set()  # those that failed (or ran out of time)
        runs = [(e, o) for o in args.optimizer.split(",") for e in engines]
        for frac in fracs:  # fractions outer, engines inner: a time limit cuts all alike
            for engine, optimizer in runs:
                key = (engine, optimizer)
                if key in done:
                    continue
                left = None if args.time_limit is None else \
                    args.time_limit - (time.monotonic() - start)
                if left is not None and key in last and left < 1.1 * last[key]:
                    print(f"[memfloor] {engine} {optimizer} {frac:.2f}: skipped, {left:.0f} s "
                          "left", flush=True)
                    done.add(key)
                    continue
                t0 = time.monotonic()
                timeout = args.run_timeout if left is None else \
                    max(30.0, min(args.run_timeout, left - 5))
                path = _run(engine, frac, optimizer, args.out_dir, extra, timeout)
                last[key] = time.monotonic() - t0
                r = _row(path)
                print(f"[memfloor] {engine} {optimizer} {frac:.2f}: {r['status']} "
                      f"({last[key]:.0f} s)", flush=True)
                if r["status"] != "ok":
                    done.add(key)
        dirs = [args.out_dir]
    summary = summarize(dirs)
    out = args.out or os.path.join(args.out_dir, "memfloor")
    with open(out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
