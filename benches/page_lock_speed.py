"""How fast this machine page-locks host memory for the device: zbuf's ``page_lock`` (pages
touched by threads, then ``cuMemHostRegister``) on ordinary and on huge-page-advised memory,
from one thread and from several at once, beside torch's ``pin_memory`` allocation.

    python benches/page_lock_speed.py [--gib 2] [--threads 4]

Prints one JSON line per case (GB/s of bytes locked per wall second). [Note: host arenas and the
first offloaded step] in zbuf/compile/block_offload.py says why it matters: at qwen3-14b the
offloaded blocks' 33 GB of arenas took 25 s to lock on an H100 machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from zbuf._core import page_lock, page_unlock


def _region(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def lock_case(nbytes: int, threads: int, huge: bool) -> dict:
    regions = [_region(nbytes, huge) for _ in range(threads)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: page_lock(0, r[1], nbytes), regions))
    seconds = time.perf_counter() - start
    for _, ptr in regions:
        page_unlock(0, ptr)
    return {"case": "page_lock", "huge_pages": huge, "threads": threads,
            "bytes": nbytes * threads, "seconds": seconds,
            "gb_per_second": nbytes * threads / seconds / 1e9}


def pin_case(nbytes: int) -> dict:
    start = time.perf_counter()
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - start
    del t
    return {"case": "torch pin_memory", "bytes": nbytes, "seconds": seconds,
            "gb_per_second": nbytes / seconds / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB per region")
    p.add_argument("--threads", type=int, default=4, help="regions locked at once")
    args = p.parse_args()
    torch.cuda.init()
    nbytes = int(args.gib * (1 << 30))
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = None
    print(json.dumps({"transparent_hugepage": thp, "cpus": torch.get_num_threads()}))
    for huge in (False, True):
        for threads in (1, args.threads):
            print(json.dumps(lock_case(nbytes, threads, huge)))
    print(json.dumps(pin_case(nbytes)))


if __name__ == "__main__":
    main()
