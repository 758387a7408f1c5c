"""Can this machine hold the ranks asked for? Checked before any worker starts.

A rank count the machine cannot hold fails late and badly: 64 CPU ranks on a 2-core, 23 GiB
machine ran for 7 minutes into the kernel's out-of-memory killer. So ``zbuf train`` / ``bench``
refuse it up front (``ConfigError``, exit status 2): with GPUs, more ranks than GPUs (one rank
per GPU, checked where the world size is decided); on CPU, more memory than is available,
by the estimate below.

[Note: memory per CPU rank]
What one CPU rank needs, measured on torch 2.11 with the tiny preset (``/proc/PID/smaps_rollup``
of the workers while they train; RSS counts torch's shared libraries in every rank, so it
over-counts):

- private memory of the runtime (torch, its dispatcher tables, gloo, the engine's compiler):
  430 MiB for ``zbuf-eager``, 530 MiB with ``aot_eager`` compiling; the estimate takes
  ``RUNTIME_BYTES`` below each, so that it only refuses what clearly does not fit;
- shared, once per machine: torch's libraries, about 290 MiB (``SHARED_BYTES``);
- the model: every engine builds the full fp32 model on every rank before it shards or wraps it
  (4 bytes per parameter), then keeps fp32 parameters, gradients and two AdamW moments (16 bytes
  per parameter): all of them for ``ddp``, a 1/world share for the sharded engines;
- activations: the fp32 logits, their log-softmax and gradient (12 bytes per token per
  vocabulary entry), and per layer about ``4 * (10 * hidden + 3 * ffn)`` bytes per token
  without activation checkpointing.

It is an estimate: it catches a rank count that is off by a large factor, not one that is off by
a few percent.

[Note: CPU ranks and cores]
Memory is not the only limit: ranks beyond one per core time-share the cores, and each step
waits for the slowest rank, so N ranks on C < N cores take about N / C times as long per step as
the same work on N cores, and gloo collectives stall on ranks the scheduler has parked. Such a
run still works (it is how the suite tests many-rank logic on a 2-core machine), so it is not
refused: ``cpu_oversubscription`` is a one-line note of its cost, and when memory refuses a rank
count the count suggested is capped at the cores.
"""

from __future__ import annotations

from typing import Optional

from ..memory import host_cores
from .config import ConfigError, Engine, TrainConfig, format_bytes

__all__ = ["RUNTIME_BYTES", "SHARED_BYTES", "available_memory", "cpu_rank_bytes",
           "check_cpu_memory", "cpu_oversubscription", "host_memory_bytes"]

RUNTIME_BYTES = {"compiled": 480 << 20, "eager": 400 << 20}
"""Private memory of one CPU rank's runtime, by whether the engine compiles ([Note: memory per
CPU rank])."""

SHARED_BYTES = 280 << 20
"""torch's shared libraries, resident once however many ranks map them."""


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit


def available_memory() -> Optional[int]:
    """Bytes a new process can use now: the kernel's ``MemAvailable``, capped by this
    container's cgroup limit minus its usage; None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 "no limit" is ~2^63
            found.append(max(0, cap - used))
    return min(found) if found else None


def cpu_oversubscription(cfg: TrainConfig, cores: Optional[int] = None) -> Optional[str]:
    """What ``cfg.nproc`` CPU ranks on ``cores`` cores (default ``host_cores()``) cost when they
    are more than the cores, in one line; None when each rank has a core ([Note: CPU ranks and
    cores])."""
    cores = host_cores() if cores is None else cores
    world = cfg.processes
    if world <= cores:
        return None
    return (f"--nproc {world} on {cores} CPU core{'s' if cores > 1 else ''}: the ranks share the "
            f"cores, so each step takes about {world / cores:.3g}x as long as with a core per "
            f"rank; --nproc {cores} uses each core once")


def host_memory_bytes() -> Optional[int]:
    """The machine's memory (``MemTotal``, capped by this container's cgroup limit); None where
    neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    except OSError:
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        cap = _read_int(limit)
        if cap is not None and cap < 1 << 60:
            found.append(cap)
    return min(found) if found else None


def cpu_rank_bytes(cfg: TrainConfig, world: int) -> int:
    """Estimated private memory of one CPU rank of ``world`` running ``cfg`` (resolved), the
    most demanding of its engines ([Note: memory per CPU rank])."""
    m = cfg.model_config()
    params = m.num_params()
    tokens = cfg.micro_batch * cfg.seq_len
    logits = 12 * tokens * m.vocab_size
    per_layer = 4 * tokens * (10 * m.hidden_size + 3 * m.ffn_hidden_size)
    if cfg.ac:  # each block keeps its input; one block's activations exist at a time
        layers = per_layer + m.num_layers * 4 * tokens * m.hidden_size
    else:
        layers = m.num_layers * per_layer
    need = 0
    for engine in cfg.engines:
        states = 16 * params if engine is Engine.DDP else -(-16 * params // world)
        runtime = RUNTIME_BYTES["compiled" if engine.compiles else "eager"]
        need = max(need, runtime + 4 * params + states + logits + layers)
    return need


def check_cpu_memory(cfg: TrainConfig, available: Optional[int] = None,
                     cores: Optional[int] = None) -> None:
    """``ConfigError`` when ``cfg.nproc`` CPU ranks would need more memory than is available
    (``available``: bytes, default ``available_memory()``); the message says how many fit, at
    most one per core (``cores``: default ``host_cores()``; [Note: CPU ranks and cores])."""
    available = available_memory() if available is None else available
    cores = host_cores() if cores is None else cores
    if available is None:
        return  # nothing to compare with; the run will tell
    world = cfg.nproc
    total = SHARED_BYTES + cfg.processes * cpu_rank_bytes(cfg, world)  # simulated: one process
    if total <= available:
        return
    fits = [n for n in range(1, world) if SHARED_BYTES + n * cpu_rank_bytes(cfg, n) <= available]
    if not fits:
        fix = ("even one rank does not fit: use a smaller --preset, --layers, --micro-batch or "
               "--seq-len")
    elif fits[-1] > cores:
        fix = (f"use --nproc {cores} or fewer ({fits[-1]} would fit in memory, but on {cores} "
               f"CPU cores more ranks only share them: each step about ranks / {cores} times "
               f"slower)")
    else:
        fix = f"use --nproc {fits[-1]} or fewer"
    raise ConfigError(
        f"--nproc {world}: {world} CPU ranks need about {format_bytes(total)} of memory "
        f"({format_bytes(cpu_rank_bytes(cfg, world))} per rank, estimated for {cfg.preset}), but "
        f"only {format_bytes(available)} is available; {fix}")
