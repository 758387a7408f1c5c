"""``zbuf fit``: the largest micro-batch that trains on a card of a given size, found by running
simulated steps ([Note: simulated ranks] in simulate.py) on this machine.

[Note: fitting a micro-batch]
The question users ask before they rent GPUs: for this model, world size, card and sequence
length, which micro-batch fits? A probe runs one micro-batch as rank 0 of the world size over the
fake group, on an emulated card of ``--gpu-memory`` (torch's allocator and zbuf's pool together,
[Note: emulated capacity] in zbuf/memory/shared.py), for ``--steps`` steps of which ``--warmup`` are
warm-up: it fits when it finishes without an out-of-memory error, without an allocator retry
after the warm-up (a retry is a cache flush in the step: the slow path of a card that is
almost full) and with rank 0's peak within the card. Each probe is a process of its own with a
time limit (``--probe-timeout``), killed with everything it started when the limit passes, so
an out-of-memory crash or a hang ends that probe as "does not fit" and the search goes on.

The search doubles the micro-batch from 1 until a probe fails (or ``--max-micro-batch``), then
bisects between the largest that fit and the smallest that did not. It assumes that memory
grows with the micro-batch, which it does for every engine here (activations are linear in it).

On CPU the card is a stand-in: no allocator refuses memory there, so a probe fits when rank 0's
peak resident memory (what the record calls peak RSS: torch's runtime, the model's shards, their
gradients and optimizer state, the activations) stays within ``--gpu-memory``. That keeps the
search and its bounds testable without a GPU; the number means "fits in this much host memory",
and the output calls it peak RSS and says so (a probe of a 2.4M-parameter model reads about
800 MiB, most of it torch's own).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple, Optional

from ..compile.recompute import LEVELS
from .config import TrainConfig, format_bytes
from .record import FIT_SCHEMA

__all__ = ["Probe", "FitResult", "probe", "read_probe", "verdict", "fit", "FIT_SCHEMA"]



class Probe(NamedTuple):
    """One micro-batch tried."""

    micro_batch: int
    fits: bool
    why: str
    """"fits", or what failed: out of memory, retries after warm-up, over the card, timeout."""
    peak_bytes: Optional[int]
    """Rank 0's peak device memory (CUDA: reserved + pool high water; CPU: the process's peak
    resident set, torch's runtime included: [Note: fitting a micro-batch])."""
    headroom_bytes: Optional[int]
    """The card less ``peak_bytes``."""
    retries_warmup: Optional[int]
    retries_measured: Optional[int]
    step_time_s: Optional[float]
    """Median measured step time (compute and memory only: simulated)."""
    seconds: float
    """Wall time of the probe, process start to end."""
    offloaded_bytes: Optional[int] = None
    """Optimizer state the zbuf engine kept in host memory to fit ([Note: offloading when the
    step does not fit] in zbuf/offload_choice.py); None: none moved."""
    retries_by_step: Optional[list[int]] = None
    """Rank 0's allocator retries in each step, warm-up included: whether they stopped within
    the warm-up or were still coming in the last step (a longer run would retry on)."""
    activations: Optional[dict[str, int]] = None
    """What the plan did with the blocks' activations, as its last step ran: block calls at each
    recompute level (``zbuf.compile.recompute.LEVELS``) and, under ``"offloaded"``, how many
    of them sent theirs to host memory ([Note: offloaded blocks] in
    zbuf/compile/block_offload.py); None: not block frames. A micro-batch with the room keeps
    or offloads what a larger one recomputes, so its step per sample is shorter."""


class FitResult(NamedTuple):
    micro_batch: int
    """The largest micro-batch that fit (0: not even 1)."""
    probes: list[Probe]

    def to_json(self, cfg: TrainConfig) -> dict[str, Any]:
        return {"schema": FIT_SCHEMA, "config": cfg.to_json(), "card_bytes": cfg.gpu_memory,
                "world_size": cfg.simulate_world, "micro_batch": self.micro_batch,
                "probes": [p._asdict() for p in self.probes]}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def probe(cfg: TrainConfig, micro_batch: int, timeout_s: float) -> Probe:
    """Run ``cfg`` (resolved, simulated, one engine) at ``micro_batch`` in a worker process of
    its own, bounded by ``timeout_s`` ([Note: fitting a micro-batch])."""
    run = dataclasses.replace(cfg, micro_batch=micro_batch, global_batch=micro_batch * cfg.nproc,
                              progress=False)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zbuf-fit-") as tmp:
        spec, partial = os.path.join(tmp, "spec.json"), os.path.join(tmp, "partial.json")
        with open(spec, "w") as f:
            json.dump({"config": run.to_json(), "runs": [0], "partial": partial,
                       "threads": os.cpu_count() or 1, "command": "fit", "argv": None}, f)
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        with open(os.path.join(tmp, "log"), "w+") as log:
            proc = subprocess.Popen([sys.executable, "-m", "zbuf.train.worker", spec], env=env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its compile workers die with it
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return Probe(micro_batch, False, f"no result within {timeout_s:g} s", None, None,
                             None, None, None, time.perf_counter() - t0)
            log.seek(0)
            text = log.read()
        seconds = time.perf_counter() - t0
        err = f"{partial}.rank0.err"
        if code != 0 or not os.path.exists(partial):
            cause = open(err).read() if os.path.exists(err) else text
            oom = "out of memory" in cause.lower() or "OutOfMemory" in cause
            last = next((ln for ln in reversed(cause.splitlines()) if ln.strip()), "")
            why = "out of memory" if oom else f"failed (exit {code}): {last[:200]}"
            return Probe(micro_batch, False, why, None, None, None, None, None, seconds)
        with open(partial) as f:
            eng = json.load(f)["engines"][0]
    return read_probe(micro_batch, eng, cfg.gpu_memory, seconds)


def read_probe(micro_batch: int, eng: dict[str, Any], card_bytes: int, seconds: float) -> Probe:
    """The probe of ``micro_batch`` from its run's engine record ``eng`` (a finished run)."""
    rank0 = eng["per_rank"][0]
    peak = rank0["peak_device_bytes"]
    warm = rank0["alloc_retries_total"] - rank0["alloc_retries_measured"]
    measured = rank0["alloc_retries_measured"]
    times = sorted(s["time_s"] for s in eng["steps"][eng["warmup_steps"]:])
    median = times[len(times) // 2] if times else None
    why = verdict(peak, card_bytes, measured)
    offload = (eng.get("step_memory") or {}).get("optimizer_offload") or {}
    moved = offload.get("offloaded_state_bytes") if offload.get("active") else None
    totals = [0] + [s["alloc_retries"][0] for s in eng["steps"]]  # each step's, cumulative
    return Probe(micro_batch, why == "fits", why, peak, card_bytes - peak, warm, measured,
                 median, seconds, moved, [b - a for a, b in zip(totals, totals[1:])],
                 _activations(eng))


def _blocks_moved(activations: Optional[dict[str, int]]) -> str:
    """The probe line's account of the blocks, once the plan moved any block call off level 0
    (the model's own checkpointing, which under ``--ac off`` recomputes nothing); else ""."""
    if not activations or not any(activations[level] for level in LEVELS[1:]):
        return ""
    levels = ", ".join(f"{activations[level]} {level}" for level in LEVELS if activations[level])
    offloaded = activations["offloaded"]
    return f"  blocks: {levels}" + (f" ({offloaded} offloaded)" if offloaded else "")


def _activations(eng: dict[str, Any]) -> Optional[dict[str, int]]:
    """``Probe.activations`` from a block frames run's schedule (None for any other run)."""
    blocks = (eng.get("schedule") or {}).get("blocks")
    if not isinstance(blocks, dict) or blocks.get("levels") is None:
        return None
    counts = {level: blocks["levels"].count(level) for level in LEVELS}
    counts["offloaded"] = len((blocks.get("activation_offload") or {}).get("blocks") or [])
    return counts


def verdict(peak_bytes: int, card_bytes: int, retries_measured: int) -> str:
    """"fits", or why a probe that finished does not ([Note: fitting a micro-batch])."""
    if retries_measured:
        return f"{retries_measured} allocator retries after warm-up"
    if peak_bytes > card_bytes:  # by how much: rounded, "peak 1.00 GiB" is over a 1.00 GiB card
        return (f"peak {format_bytes(peak_bytes)} is {format_bytes(peak_bytes - card_bytes)} "
                f"over the {format_bytes(card_bytes)} card")
    return "fits"


def fit(cfg: TrainConfig, *, max_micro_batch: int, timeout_s: float, min_micro_batch: int = 1,
        report=lambda p: None) -> FitResult:
    """The largest micro-batch <= ``max_micro_batch`` that fits ([Note: fitting a
    micro-batch]), doubling from ``min_micro_batch`` (bisecting below it if that does not fit);
    ``report(probe)`` is called after every probe."""
    probes: dict[int, Probe] = {}

    def tried(mb: int) -> bool:
        if mb not in probes:
            probes[mb] = probe(cfg, mb, timeout_s)
            report(probes[mb])
        return probes[mb].fits

    good, bad, mb = 0, None, min(min_micro_batch, max_micro_batch)
    while mb <= max_micro_batch:
        if not tried(mb):
            bad = mb
            break
        good, mb = mb, (mb * 2 if mb * 2 <= max_micro_batch or mb == max_micro_batch
                        else max_micro_batch)
    if bad is None:
        if good < max_micro_batch and not tried(max_micro_batch):
            bad = max_micro_batch
        else:
            good = max_micro_batch
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if tried(mid):
            good = mid
        else:
            bad = mid
    return FitResult(good, [probes[k] for k in probes])


def main(cfg: TrainConfig, *, max_micro_batch: int, timeout_s: float, min_micro_batch: int = 1,
         console=None) -> int:
    """``zbuf fit``: exit status 0 with an answer, 1 when not even micro-batch 1 fits, 2 on a bad
    option."""
    from rich.console import Console

    from .errors import ConfigError
    from .progress import print_error
    from .runner import prepare

    console = console or Console()
    try:
        if cfg.simulate_world is None or cfg.gpu_memory is None:
            raise ConfigError("zbuf fit needs the world size and the card: --simulate-world N "
                              "--gpu-memory SIZE, e.g. --simulate-world 8 --gpu-memory 80GiB")
        if min_micro_batch > max_micro_batch:
            raise ConfigError(f"--min-micro-batch {min_micro_batch} is above --max-micro-batch "
                              f"{max_micro_batch}: the search runs from the first up to the "
                              f"second; give a minimum no larger than the maximum")
        if cfg.micro_batch is not None or cfg.global_batch is not None:
            raise ConfigError("zbuf fit searches the micro-batch: drop --micro-batch / "
                              "--global-batch (bound the search with --max-micro-batch)")
        cfg = prepare(cfg, bench=False)
    except ConfigError as e:
        print_error("fit", str(e))
        return 2
    console.print(f"zbuf fit: {cfg.preset if not cfg.hf_model else 'hf:' + cfg.hf_model}, "
                  f"{cfg.engines[0].value}, rank 0 of {cfg.nproc} (simulated), card "
                  f"{format_bytes(cfg.gpu_memory)}, seq {cfg.seq_len}, AC {cfg.ac}, "
                  f"{cfg.warmup} warm-up + {cfg.steps - cfg.warmup} measured steps per probe",
                  highlight=False, markup=False, soft_wrap=True)
    cpu = cfg.device != "cuda"
    if cpu:  # no card to measure: say what the number is
        console.print("on CPU the card is a stand-in: peak RSS is the probe process's peak "
                      "resident memory (torch's runtime included), which must stay within the "
                      "card", highlight=False, markup=False, soft_wrap=True)

    def show(p: Probe) -> None:
        peak = format_bytes(p.peak_bytes) if p.peak_bytes is not None else "-"
        room = format_bytes(p.headroom_bytes) if p.headroom_bytes is not None else "-"
        retries = "-" if p.retries_warmup is None else f"{p.retries_warmup}/{p.retries_measured}"
        step = "-" if p.step_time_s is None else f"{p.step_time_s * 1e3:,.0f} ms"
        console.print(f"  micro-batch {p.micro_batch:>4}: {'fits' if p.fits else 'no  '}  "
                      f"{'peak RSS' if cpu else 'peak'} {peak:>11}  headroom {room:>11}  "
                      f"retries warm-up/measured {retries:>5}  "
                      f"step {step:>9}  ({p.seconds:.0f} s){'' if p.fits else '  ' + p.why}"
                      + ("" if p.offloaded_bytes is None else
                         f"  optimizer state offloaded {format_bytes(p.offloaded_bytes)}")
                      + _blocks_moved(p.activations),
                      highlight=False, markup=False, soft_wrap=True)

    result = fit(cfg, max_micro_batch=max_micro_batch, timeout_s=timeout_s,
                 min_micro_batch=min_micro_batch, report=show)
    with open(cfg.out, "w") as f:
        json.dump(result.to_json(cfg), f, indent=1)
    if result.micro_batch:
        console.print(f"largest micro-batch that fits: {result.micro_batch} (of at most "
                      f"{max_micro_batch}); record: {cfg.out}", highlight=False, markup=False)
        return 0
    console.print(f"not even micro-batch 1 fits on {format_bytes(cfg.gpu_memory)}; record: "
                  f"{cfg.out}", highlight=False, markup=False)
    return 1
