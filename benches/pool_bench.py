"""Host-time benchmark of the gather-buffer pool against torch's allocator.

For gather-sized buffers (1 MiB .. 1 GiB) it measures, per acquire+release pair, the host time
of:
  * ``core_pair``:  the Rust core alone (lock, best fit, release event; no tensor);
  * ``pool_pair``:  ``pool.acquire`` + ``pool.release`` (the full Python path, torch tensor
    included): the number the <= 2 us target is about;
  * ``pool_drop``:  ``pool.acquire`` + dropping the tensor (the DLPack deleter returns it);
  * ``torch_empty``: ``torch.empty`` + dropping it (CUDA caching allocator on GPU, the system
    allocator on CPU);
  * ``dlpack_floor``: torch exporting one of its own tensors to DLPack and importing it back
    (``_to_dlpack_versioned`` + ``_from_dlpack`` + drop): what any DLPack handoff into torch
    costs, the floor under ``pool_drop``.
All are hits after warm-up (the pool reuses its block; the caching allocator its cached block).
No device synchronisation inside the timed loops: host time is what is measured.

Usage: python benches/pool_bench.py [--device cpu|cuda|all] [--out benches/results]
Writes pool_<device>.json and pool_<device>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from zbuf.pool import GatherBufferPool

MiB = 1 << 20
SIZES = [1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]


def per_iter_ns(fn, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean ns per call of `fn` run `iters` times."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    if os.environ.get("ZBUF_COMMIT"):
        return os.environ["ZBUF_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_device(device: str, iters: int, repeats: int) -> dict:
    is_cuda = device == "cuda"
    pool = GatherBufferPool(device, budget_bytes=4 << 30, hard_cap_bytes=8 << 30)
    stream = torch.cuda.current_stream().cuda_stream if is_cuda else 0
    rows = []
    for size in SIZES:
        shape = (size // 4,)
        n = iters if size <= 16 * MiB else max(iters // 10, 200)

        def pool_pair():
            pool.release(pool.acquire(shape, torch.float32))

        def pool_drop():
            pool.acquire(shape, torch.float32)

        def torch_empty():
            torch.empty(shape, dtype=torch.float32, device=device)

        probe = torch.empty(16, device=device)

        def dlpack_floor():
            torch._C._from_dlpack(torch._C._to_dlpack_versioned(probe))

        row = {
            "bytes": size,
            "iters": n,
            "core_pair_ns": statistics.median(
                pool._core._bench_core_pair(size, n, stream) for _ in range(repeats)),
            "pool_pair_ns": per_iter_ns(pool_pair, n, repeats),
            "pool_drop_ns": per_iter_ns(pool_drop, n, repeats),
            "torch_empty_ns": per_iter_ns(torch_empty, n, repeats),
            "dlpack_floor_ns": per_iter_ns(dlpack_floor, n, repeats),
        }
        row["pool_pair_vs_torch"] = row["pool_pair_ns"] / row["torch_empty_ns"]
        row["pool_drop_vs_torch"] = row["pool_drop_ns"] / row["torch_empty_ns"]
        rows.append(row)
        pool.trim()
        if is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    s = pool.stats()
    return {
        "meta": {
            "device": device,
            "device_name": torch.cuda.get_device_name() if is_cuda else cpu_model(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "zbuf_commit": git_commit(),
            "repeats": repeats,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "pool_misses": s.misses,
        "rows": rows,
    }


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# Pool host-time benchmark: {m['device']} ({m['device_name']})",
        "",
        f"torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, {m['cpu']} x{m['cpu_count']}, "
        f"load avg {m['load_average_1m']:.1f}, zbuf {m['zbuf_commit']}, {m['date_utc']}.",
        "Per acquire+release pair, microseconds of host time (median of "
        f"{m['repeats']} runs); every pair is a hit after warm-up.",
        "",
        "| size | Rust core pair | pool acquire+release | pool acquire+drop | "
        "torch.empty+drop | DLPack floor | pool pair / torch | pool drop / torch |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['bytes'] // MiB} MiB | {r['core_pair_ns'] / 1e3:.2f} | {r['pool_pair_ns'] / 1e3:.2f} | "
            f"{r['pool_drop_ns'] / 1e3:.2f} | {r['torch_empty_ns'] / 1e3:.2f} | "
            f"{r['dlpack_floor_ns'] / 1e3:.2f} | "
            f"{r['pool_pair_vs_torch']:.2f} | {r['pool_drop_vs_torch']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            print("no CUDA device: run with --device cpu", file=sys.stderr)
            return 2
        devices.remove("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for device in devices:
        result = bench_device(device, args.iters, args.repeats)
        (out / f"pool_{device}.json").write_text(json.dumps(result, indent=2) + "\n")
        md = to_markdown(result)
        (out / f"pool_{device}.md").write_text(md)
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
