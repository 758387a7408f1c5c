"""Inductor's kernel-compile workers start when zbuf shards a model on CUDA ([Note: compile
workers started early] in zbuf/compile_workers.py), before anything is compiled; on the CPU,
and under torch's own ``TORCH_WARM_POOL=0``, none start.

Each case runs in a process of its own: the pool is process-global torch state."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import sys, time
import torch
from torch._inductor.async_compile import AsyncCompile
from zbuf.compile_workers import start_compile_workers

start_compile_workers(torch.device(sys.argv[1]))
started = AsyncCompile._ready_future is not None
if started:  # the workers answer a first job without anything compiled
    AsyncCompile._ready_future.result(timeout=120)
print(started, torch._dynamo.utils.counters["stats"]["calls_captured"])
"""


@pytest.mark.parametrize("device,warm,started", [
    ("cuda", "1", True), ("cpu", "1", False), ("cuda", "0", False)])
def test_the_compile_workers_start_for_a_cuda_model_only(device, warm, started):
    pytest.importorskip("triton")  # Inductor's pool compiles Triton kernels only
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="2", TORCH_WARM_POOL=warm)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, device], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(started), "0"]
