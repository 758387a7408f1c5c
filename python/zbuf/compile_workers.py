"""Inductor's kernel-compile workers, started by ``zbuf.shard`` on a CUDA device.

[Note: compile workers started early]
Inductor compiles Triton kernels in a pool of worker processes that its first compile starts
(torch's ``"inductor"`` backend, when Dynamo first hands it a graph), and it compiles a kernel in
the calling process, one after another, until the pool has answered a first job. In step 0 it had
not: at qwen3-14b as rank 0 of 8 on an H100 the level-0 block frame's kernels compiled in the
main process for 2.2-2.3 s (``async_compile.precompile``), and FSDP2's per-block compile lost
2.0-3.5 s the same way (benches/results/onepath14.md). Starting the pool in ``zbuf.compile``, 0.5 s
before that step, changed neither span: the pool took longer to answer than the step took to reach
its first kernel (about 3 s of tracing). ``zbuf.shard`` comes earlier, before the model is
materialised and the optimizer built, and a model sharded on CUDA is one zbuf will compile (eager
zbuf is the fallback, not the path), so it starts the pool there: the workers import torch beside
the materialisation and the first step's tracing instead of after the first kernel is due. It
waits for none of them. Torch's own switch turns it off (``TORCH_WARM_POOL=0``, which
``maybe_warm_pool`` reads), as it turns off torch's.
"""

from __future__ import annotations

import torch


def start_compile_workers(device: torch.device) -> None:
    """Start Inductor's kernel-compile pool now when ``device`` is CUDA, without waiting for it."""
    if device.type != "cuda":
        return  # Inductor's pool compiles Triton kernels only: the CPU's C++ is compiled inline
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
