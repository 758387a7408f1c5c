"""Whether page-locking the offloaded blocks' host arenas slows the Python thread's compile.

At qwen3-14b the re-plan's step (the "selective" frame compiled while its arenas are locked in
the background, [Note: host arenas and the first offloaded step] in
zbuf/compile/block_offload.py) spent 4.1-5.0 s in AOTAutograd where the locking took 15.8-19.5 s
(summed over the arenas), and 1.8-1.9 s where it took 7.5-8.3 s (benches/results/onepath14.md).
A first probe, tracing CPU tensors beside the locking, slowed by 3 % at most. This one separates
what the Python thread does while it compiles:

- ``trace``: ``make_fx`` of a qwen3-shaped block's forward and backward over fake CUDA tensors
  (AOTAutograd's joint trace, in small);
- ``driver``: a loop of tiny CUDA launches, each followed by an event query (driver calls, which
  wait for a lock the page-locking's ``cuMemHostRegister`` may hold).

Each runs alone, then beside the arenas being locked as ``BlockOffload.plan`` locks them
(``PIN_THREADS`` arenas at once, ``touch_threads_per_arena`` threads each), then beside each
part of that alone: their pages faulted in by touching them, their pages (touched before)
registered with ``cudaHostRegister``, their pages faulted in by one ``MADV_POPULATE_WRITE``
where the kernel takes it. The record gives each run's wall time and, for ``driver``, its
slowest call: a slowdown beside one part and not another names what the Python thread waits
for (on an H200 under gVisor the re-plan's pure-Python passes ran 3-17 times slower beside the
locking: benches/results/onepath14.md). First, one arena's locking split into its parts
(``split`` in the record), each timed alone.

Usage (one GPU): ``python benches/lock_contention.py --arenas 16 --arena-gb 1.7 --out DIR``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from zbuf.compile.block_offload import PIN_THREADS, touch_threads_per_arena
from zbuf.host_arena import HostArena
from zbuf.memory import host_core_share


HEADS, KV_HEADS = 4, 2
"""The traced block's attention heads (grouped-query: two queries a key-value head)."""


def block_loss(x, cos, sin, wq, wk, wv, wo, wg, wu, wd):
    """A qwen3 block's computation (RMSNorm, GQA attention with rotary tables, SwiGLU MLP)."""
    heads, kv_heads = HEADS, KV_HEADS
    b, t, h = x.shape
    d = wq.shape[0] // heads
    n = F.rms_norm(x, (h,))
    q = (n @ wq.T).view(b, t, heads, d).transpose(1, 2)
    k = (n @ wk.T).view(b, t, kv_heads, d).transpose(1, 2)
    v = (n @ wv.T).view(b, t, kv_heads, d).transpose(1, 2)
    q = F.rms_norm(q, (d,)) * cos + torch.cat((-q[..., d // 2:], q[..., :d // 2]), -1) * sin
    k = F.rms_norm(k, (d,)) * cos + torch.cat((-k[..., d // 2:], k[..., :d // 2]), -1) * sin
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + a.transpose(1, 2).reshape(b, t, -1) @ wo.T
    m = F.rms_norm(x, (h,))
    x = x + (F.silu(m @ wg.T) * (m @ wu.T)) @ wd.T
    return x.float().square().mean()


def trace_work(iters: int) -> float:
    """Seconds to trace the block's joint graph ``iters`` times over fake CUDA tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    dev = torch.device("cuda")
    h, d, f = 256, 64, 512
    args = [torch.randn(2, 64, h, device=dev, dtype=torch.bfloat16),
            torch.randn(64, d, device=dev, dtype=torch.bfloat16),
            torch.randn(64, d, device=dev, dtype=torch.bfloat16)]
    weights = [torch.randn(o, i, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for o, i in ((4 * d, h), (2 * d, h), (2 * d, h), (h, 4 * d), (f, h), (f, h),
                            (h, f))]
    joint = torch.func.grad(block_loss, argnums=tuple(range(3, 10)))
    start = time.perf_counter()
    for _ in range(iters):
        make_fx(joint, tracing_mode="fake")(*args, *weights)
    return time.perf_counter() - start


def driver_work(iters: int) -> tuple[float, float]:
    """Seconds for ``iters`` tiny launches each followed by an event query, and the slowest."""
    x = torch.ones(16, device="cuda")
    slowest = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        x = x * 1.0
        torch.cuda.current_stream().record_event().query()
        slowest = max(slowest, time.perf_counter() - t)
    return time.perf_counter() - start, slowest


MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
_LIBC = ctypes.CDLL(None, use_errno=True)


def populate(memory: torch.Tensor) -> float:
    """Seconds to fault ``memory``'s pages in with one ``madvise`` (huge pages advised first, as
    ``page_lock`` advises them); raises where the kernel refuses it."""
    huge = 2 << 20
    ptr, n = memory.data_ptr(), memory.numel()
    start, end = -(-ptr // huge) * huge, (ptr + n) // huge * huge
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    page = 4096
    first = -(-ptr // page) * page  # madvise takes whole pages; the partial first one stays
    began = time.perf_counter()
    if _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(ptr + n - first),
                     MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
    return time.perf_counter() - began


def _register_seconds(memory: torch.Tensor) -> float | str:
    """Seconds ``cudaHostRegister`` took to lock ``memory`` (unlocked after), or why it refused."""
    t = time.perf_counter()
    try:
        _registered(memory)
    except RuntimeError as e:
        return f"refused: {e}"
    seconds = time.perf_counter() - t
    torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
    return seconds


def split(nbytes: int, touch: int) -> dict:
    """One arena's locking in parts: the pages touched (strided writes), then registered; the
    pages populated by one ``madvise``, then registered; ``HostArena`` as zbuf builds it."""
    out = {}
    t = time.perf_counter()
    memory = _touched(nbytes)
    out["touch_s"] = time.perf_counter() - t
    out["register_after_touch_s"] = _register_seconds(memory)
    memory = torch.empty(nbytes, dtype=torch.uint8)
    try:
        out["populate_s"] = populate(memory)
    except OSError as e:
        out["populate_s"] = f"refused: {e}"
    out["register_after_populate_s"] = _register_seconds(memory)
    del memory
    t = time.perf_counter()
    arena = HostArena(nbytes, torch.device("cuda"), (), touch)
    out["host_arena_s"] = time.perf_counter() - t
    out["host_arena_touch_s"], out["host_arena_register_s"] = (arena.touch_seconds,
                                                                arena.register_seconds)
    del arena
    print({"split": out}, flush=True)
    return out


def _touched(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory, every page faulted in by a write."""
    memory = torch.empty(nbytes, dtype=torch.uint8)
    memory[::4096].zero_()
    return memory


BUILDS = {
    # What the arenas' threads do beside the work: zbuf's whole locking, or one part of it.
    "arena": lambda nbytes, touch: HostArena(nbytes, torch.device("cuda"), (), touch),
    "touch": lambda nbytes, touch: _touched(nbytes),
    "populate": lambda nbytes, touch: populate(torch.empty(nbytes, dtype=torch.uint8)),
    "register": lambda memory, touch: _registered(memory),
}


def _registered(memory: torch.Tensor) -> torch.Tensor:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(),
                                                                memory.numel(), 0))
    return memory


def run(name: str, work, arenas: int, nbytes: int, touch: int | None,
        method: str = "arena") -> dict:
    """``work()`` alone (``touch`` None) or beside ``arenas`` arenas' ``method`` (``BUILDS``;
    "register": pages touched before the work starts)."""
    pool = ThreadPoolExecutor(PIN_THREADS) if touch is not None else None
    inputs = ([_touched(nbytes) for _ in range(arenas)] if method == "register"
              else [nbytes] * arenas)
    started = time.perf_counter()
    futures = [pool.submit(BUILDS[method], x, touch) for x in inputs] if pool else []
    out = work()
    work_s, slowest = out if isinstance(out, tuple) else (out, None)
    built = [f.result() for f in futures]
    record = {"work": name, "touch_threads": touch, "method": method if pool else None,
              "work_s": work_s, "slowest_call_s": slowest,
              "built_by_s": time.perf_counter() - started if pool else None,
              "lock_seconds": sum(a.lock_seconds for a in built if isinstance(a, HostArena))}
    if method == "register":
        for memory in built:
            torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
    del built, inputs
    if pool:
        pool.shutdown()
    print(record, flush=True)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arenas", type=int, default=16)
    p.add_argument("--arena-gb", type=float, default=1.7)
    p.add_argument("--trace-iters", type=int, default=30)
    p.add_argument("--driver-iters", type=int, default=200_000)
    p.add_argument("--out", default=None, help="directory for lock_contention.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lock_contention.py needs a CUDA device: the locking is the driver's")
    nbytes = int(args.arena_gb * 1e9)
    share = touch_threads_per_arena(host_core_share())
    works = {"trace": lambda: trace_work(args.trace_iters),
             "driver": lambda: driver_work(args.driver_iters)}
    trace_work(2), driver_work(1000)  # warm: imports, the first traces, the first launches
    parts = split(nbytes, share)
    methods = (["arena", "touch"]
               + (["register"] if isinstance(parts["register_after_touch_s"], float) else [])
               + (["populate"] if isinstance(parts["populate_s"], float) else []))
    records = [run(name, work, args.arenas, nbytes, touch, method)
               for name, work in works.items()
               for touch, method in ((None, None), *((share, m) for m in methods),
                                     (None, None))]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lock_contention.json"), "w") as f:
            json.dump({"arenas": args.arenas, "arena_bytes": nbytes,
                       "device": torch.cuda.get_device_name(), "cores": os.cpu_count(),
                       "split": parts, "runs": records}, f, indent=1)


if __name__ == "__main__":
    main()
