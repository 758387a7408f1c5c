"""What a run measures: memory counted at device level, allocator retries, MFU, versions.

[Note: fair memory]
The zbuf pool allocates with ``cuMemAlloc`` outside torch's caching allocator, so
``torch.cuda.memory_reserved`` alone would flatter zbuf. Device memory of a rank is counted as
the allocator's reserved bytes plus the pool's charged bytes; the peak as the allocator's peak
reserved plus the pool's high-water mark (an upper bound: the two peaks may not coincide). On
CPU the same columns hold the process's resident set (peak RSS), which includes the pool's host
blocks.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import socket
import subprocess
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["MemorySample", "MemoryProbe", "environment", "model_flops_utilisation",
           "peak_flops_per_second"]


class MemorySample(NamedTuple):
    """One rank's memory after a step (bytes)."""

    device_bytes: int
    """Now: allocator reserved + pool charged (CUDA) or resident set (CPU)."""
    peak_device_bytes: int
    """Since the engine's setup: peak reserved + pool high water (CUDA) or peak RSS (CPU)."""
    allocated_peak_bytes: int
    """Peak bytes of live tensors in the caching allocator (CUDA; 0 on CPU)."""
    pool_bytes: int
    """Pool charged bytes now (0 without a pool)."""
    pool_high_water_bytes: int
    """Pool high-water mark (0 without a pool)."""
    alloc_retries: int
    """Caching-allocator ``num_alloc_retries`` since the engine's setup (cudaMalloc failures
    that forced a cache flush and retry: the slow path memory pressure causes)."""


def _pool_stats(pool) -> dict[str, Any]:
    if pool is None:
        return {}
    stats = pool.stats()
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryProbe:
    """Samples one rank's memory; ``reset()`` at the start of each engine's measurement.

    The device's peak counters belong to the step's ``PhaseMeter`` ([Note: phase peaks] in
    zbuf/memory/phases.py), which resets them at every phase boundary: the peaks here are the
    running maximum of the peaks it measured, passed to ``sample``.
    """

    def __init__(self, device: torch.device, pool=None) -> None:
        self.device = device
        self.pool = pool
        self._retries0 = 0
        self._reserved_peak = 0
        self._allocated_peak = 0
        self.reset()

    def reset(self) -> None:
        self._reserved_peak = self._allocated_peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries0 = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def pool_stats(self) -> dict[str, Any]:
        return _pool_stats(self.pool)

    def sample(self, phases=None) -> MemorySample:
        """Memory after a step; ``phases``: the step's ``StepPhases`` (its peaks)."""
        ps = self.pool_stats()
        pool_now = int(ps.get("charged_bytes", 0))
        pool_hw = int(ps.get("high_water_bytes", 0))
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            if phases is not None:
                self._reserved_peak = max(self._reserved_peak, phases.reserved_peak_bytes)
                self._allocated_peak = max(self._allocated_peak, phases.allocated_peak_bytes)
            reserved_peak = max(self._reserved_peak, stats.get("reserved_bytes.all.peak", 0))
            allocated_peak = max(self._allocated_peak, stats.get("allocated_bytes.all.peak", 0))
            return MemorySample(
                device_bytes=stats.get("reserved_bytes.all.current", 0) + pool_now,
                peak_device_bytes=reserved_peak + pool_hw,
                allocated_peak_bytes=allocated_peak,
                pool_bytes=pool_now, pool_high_water_bytes=pool_hw,
                alloc_retries=stats.get("num_alloc_retries", 0) - self._retries0)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return MemorySample(_rss_bytes(), peak_rss, 0, pool_now, pool_hw, 0)

    def feed_pool(self) -> None:
        """Tell the pool about allocator pressure (retries, free memory) once per step."""
        if self.pool is not None and self.device.type == "cuda":
            observe = getattr(self.pool, "observe_torch_allocator", None)
            if observe is not None:
                observe()


# Dense bf16 peak per GPU (no sparsity), by substring of torch.cuda.get_device_name.
_PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("B200", 2250e12),
              ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("A10G", 70e12))


def peak_flops_per_second(device: torch.device, override_tflops: Optional[float],
                          dtype: str) -> Optional[float]:
    """Peak FLOP/s for MFU, or None when unknown (CPU, unlisted GPU, fp32 compute)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda" or dtype != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16:
        if key in name:
            return peak
    return None


def model_flops_utilisation(flops_per_token: Optional[float], tokens_per_s_per_gpu: float,
                            peak_flops: Optional[float]) -> Optional[float]:
    """MFU: the model's FLOPs per token (the PaLM convention: recompute not counted) times the
    tokens a GPU trains a second, over its peak; None where either is unknown."""
    if not flops_per_token or not peak_flops:
        return None
    return flops_per_token * tokens_per_s_per_gpu / peak_flops


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        # "-dirty" when tracked files differ from the commit: a record must not name a commit
        # whose code it did not run (the GPU machine runs a copy of the working tree).
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and hardware, for the record and the benchmark table header."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "zbuf_commit": _git_commit(),
        "device_type": device.type,
    }
    try:
        from importlib.metadata import version

        env["zbuf"] = version("zbuf")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source tree)
        env["zbuf"] = None
    if device.type == "cuda":
        env.update(
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            driver=_driver_version(),
            gpu=torch.cuda.get_device_name(device),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory,
        )
    return env
