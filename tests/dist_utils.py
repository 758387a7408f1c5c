"""Run a function in N gloo worker processes (CPU; NCCL for GPU tests) and collect what each returns.

    from dist_utils import run_distributed

    def _check(rank, world_size, n):          # module level: it is pickled by name
        ...                                   # torch.distributed is initialised (gloo)
        return {"loss": 1.0}                  # anything picklable

    def test_something():
        results = run_distributed(_check, 2, 10)   # [rank0 result, rank1 result]

Gloo workers are forked from a fork server that has imported torch and zbuf and done nothing
else (forking a process that has started torch's thread pools is unsafe; this one has started
none), so a worker skips the import: about 5 s of CPU per worker on CI's 2 cores (torch 2.6 s,
zbuf 2.6 s), some 50 workers a suite run. Each worker takes the caller's environment as it is at
the call (the server's is the one of the first call). NCCL workers (GPU tests) are spawned. They
rendezvous through a TCPStore that the parent opens on a free port (no port race), run
with one intra-op thread each (CI has two cores), and tear the process group down on exit. The
first worker failure is re-raised in the parent with the worker's traceback, and the other
workers are terminated (a failed rank would leave its peers blocked in a collective). A worker
that has not finished within ``timeout`` seconds fails the call the same way, naming the ranks
still running: the usual cause is a collective that not every rank issued.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["run_distributed", "WorkerFailed", "global_mean"]

_HOST = "127.0.0.1"
# What a worker's first compile imports too (1.2 s more): Inductor, AOTAutograd, the partitioner.
_PRELOAD = ["torch", "torch.distributed", "zbuf", "torch._inductor.compile_fx",
            "torch._functorch.aot_autograd", "torch._functorch.partitioners"]


def _context(backend: str):
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first call
    return ctx


class WorkerFailed(RuntimeError):
    """A worker raised, died or timed out; the message holds its traceback."""


def _worker(fn, rank, world_size, port, args, kwargs, results, threads, env, backend):
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist

    import zbuf  # noqa: F401 - before init_process_group, as the README says (and why)

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _failure_report(fn, world_size, failures: dict[int, str], results, grace: float = 3.0) -> str:
    # The first failure to arrive is often a peer's "connection closed" caused by the real one:
    # wait briefly for the others and report every rank's traceback, lowest rank first.
    deadline = time.monotonic() + grace
    while len(failures) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if not ok:
            failures[rank] = value
    parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
    return f"{fn.__name__} failed on rank(s) {sorted(failures)} of {world_size}:\n" + "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout: float = 240.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    **kwargs,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo by default).

    ``backend="nccl"`` (GPU tests) binds rank r to ``cuda:r`` before initialising the group.

    Returns the per-rank return values, indexed by rank. ``fn`` must be importable by name (a
    module-level function of a test module or package). ``env`` is added to each worker's
    environment before ``fn`` runs (NCCL workers: before torch is imported; gloo workers have
    torch and zbuf from the fork server, so a variable read at their import does not reach them).
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(backend)
    # The parent hosts the store, so port 0 picks a free port with no race between probing and use.
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, store.port, args, kwargs, results, threads,
                  {**os.environ, **(env or {})}, backend),
            name=f"zbuf-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    # A result may still be in flight from a rank that exited cleanly.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise WorkerFailed(f"{fn.__name__}: rank(s) {dead} died without a result (exit codes {codes})") from None
                elif time.monotonic() > deadline:
                    running = [r for r in range(world_size) if r not in out]
                    raise WorkerFailed(
                        f"{fn.__name__}: rank(s) {running} still running after {timeout:.0f}s "
                        f"(a collective not issued by every rank hangs like this)"
                    )
                else:
                    continue
            if not ok:
                raise WorkerFailed(_failure_report(fn, world_size, {rank: value}, results))
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive() and len(out) < world_size:
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    return [out[r] for r in range(world_size)]


def global_mean(loss, world: int, sharded: bool) -> float:
    """A step's loss as the unsharded reference sees it: the mean over ranks of each rank's mean
    (equal batch slices), or the loss itself for an unsharded run."""
    import torch.distributed as dist

    value = loss.detach().clone()
    if sharded:
        dist.all_reduce(value)
        value /= world
    return value.item()
