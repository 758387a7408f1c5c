"""``TrainConfig``: every option of ``zbuf train`` / ``zbuf bench``, typed and validated.

Validation happens in the launching process before any worker starts, so a bad option costs
no process spawn and gets one clear message naming the option and the fix (``ConfigError``).
Checks that need the machine (GPU count, writable output path) live in ``check_environment``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..faults import DEFAULT_COLLECTIVE_TIMEOUT_S
from ..models import PRESETS, ModelConfig, resolve_config
from .data import Task

__all__ = ["ConfigError", "Engine", "OPTIMIZERS", "TrainConfig", "parse_bytes", "format_bytes"]


class ConfigError(ValueError):
    """A user option that cannot work; the message says which and how to fix it."""


class Engine(str, enum.Enum):
    """How the model is distributed and compiled."""

    ZBUF = "zbuf"
    """``zbuf.shard`` + the ``zbuf`` torch.compile backend (whole model, scheduled gathers)."""
    ZBUF_EAGER = "zbuf-eager"
    """``zbuf.shard`` without compile: gathers on parameter access, re-gather in backward."""
    FSDP2 = "fsdp2"
    """torch ``fully_shard`` per block + root, per-block compile (the torchtitan recipe)."""
    DDP = "ddp"
    """No sharding: ``DistributedDataParallel`` with the whole model compiled (the floor)."""

    @property
    def uses_zbuf(self) -> bool:
        return self in (Engine.ZBUF, Engine.ZBUF_EAGER)


OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
"""``--optimizer`` choices; ``zbuf.train.engines.build_optimizer`` says what each builds."""


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"8GiB"``, ``"1.5g"``, ``"1000000"`` -> bytes (binary for K/M/G/T and *iB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a byte count; write e.g. 8GiB, 512MiB or "
                          f"1073741824")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"byte count {text!r} must be positive")
    return value


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class TrainConfig:
    """One training (or benchmark) configuration. ``None`` fields are resolved per machine by
    ``resolve`` (CPU: 2 gloo ranks, fp32, ``tiny``; GPU: every visible GPU over NCCL, bf16)."""

    engines: tuple[Engine, ...] = (Engine.ZBUF,)
    """Engines to run, in order (``zbuf train``: exactly one; ``zbuf bench``: several)."""
    preset: Optional[str] = None
    """Model preset from ``zbuf.models.PRESETS``; default ``tiny`` on CPU, ``qwen3-0.6b`` on GPU."""
    hf_model: Optional[str] = None
    """``--model hf:<model_type>``: a Hugging Face ``transformers`` causal LM of that type built
    locally with random weights and the preset's shape (no download)."""
    layers: Optional[int] = None
    """Decoder layers instead of the preset's count, each of the preset's shape: a large
    preset's harness, memory cap and per-layer behaviour on a machine too small for all of it.
    Default: the preset's own count."""
    micro_batch: Optional[int] = None
    """Sequences per rank per step; default 8 on CPU, 4 on GPU."""
    global_batch: Optional[int] = None
    """Sequences per step over all ranks; if set, split evenly: ``micro_batch = global / ranks``."""
    seq_len: Optional[int] = None
    """Tokens per sequence; default 64 on CPU, 2048 on GPU."""
    steps: Optional[int] = None
    """Optimizer steps per engine, warm-up included; default 30 (bench: 10 warm-up + 20
    measured; the CPU demo's loss falls from 5.6 to about 2.9 in 30 steps)."""
    warmup: Optional[int] = None
    """Leading steps left out of the step-time statistics (compile and allocator warm-up);
    default 3 for train, 10 for bench."""
    ac: Optional[bool] = None
    """Activation checkpointing per block; default off on CPU, on on GPU."""
    budget: Optional[int] = None
    """Gather budget in bytes for the zbuf engines (``None``: derived from free memory)."""
    mem_frac: Optional[float] = None
    """Cap usable GPU memory to this fraction of the card (emulates a smaller GPU)."""
    seed: int = 0
    """Seeds the weights and the synthetic data (identical for every engine)."""
    nproc: Optional[int] = None
    """Ranks to launch; default every visible GPU, or 2 on CPU. Under torchrun: its world size."""
    out: Optional[str] = None
    """Where the JSON record goes; default ``zbuf-train.json`` / ``zbuf-bench.json``."""
    dtype: str = "auto"
    """Compute dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``bf16`` or ``fp32``. Master
    parameters, gradients reduction and optimizer state are always fp32."""
    compiler: Optional[str] = None
    """What compiles the graphs: ``inductor`` or ``aot_eager``; default inductor on GPU,
    aot_eager on CPU (Inductor's C++ compile alone would exceed the one-minute CPU demo)."""
    optimizer: str = "adamw"
    """The optimizer, the same for every engine: ``adamw`` (torch's default implementation:
    foreach on GPU, which holds about one more copy of the shards while it steps),
    ``adamw-fused`` (one fused kernel, no shard-sized temporaries) or ``sgd`` (momentum 0.9,
    one state tensor per shard). Weight decay 0 for all."""
    lr: Optional[float] = None
    """Learning rate (constant); AdamW: default 3e-3 for ``tiny``, 3e-4 for the Qwen3 presets
    (3e-3 makes a 1.7B model diverge within ten steps); SGD: 0.1 for ``tiny`` (its loss falls
    from 5.6 to 2.7 in 30 steps on the CPU default), 1e-2 for the Qwen3 presets."""
    task: Task = Task.STRIDE
    """Synthetic task (see ``zbuf.train.data.Task``)."""
    device: str = "auto"
    """``auto`` (CUDA if present), ``cpu`` or ``cuda``."""
    peak_tflops: Optional[float] = None
    """Peak dense bf16 TFLOP/s per GPU for MFU; default from the GPU name (H100/H200: 989)."""
    profile_dir: Optional[str] = None
    """Run 2 extra steps per engine under ``torch.profiler`` after the measured ones and write
    each rank's gzipped Chrome trace and a summary of device busy / exposed communication / idle
    time there (``zbuf.train.profile``); None: no profiling."""
    progress: bool = True
    """Live progress bar on rank 0."""
    checkpoint_dir: Optional[str] = None
    """Root of the run's ``step_<N>`` checkpoints (``zbuf.checkpoint``); None: no checkpoints.
    zbuf engines only (``zbuf``, ``zbuf-eager``): the checkpoint format is zbuf's sharded one."""
    save_every: Optional[int] = None
    """Save a checkpoint after every this many completed steps (needs ``checkpoint_dir``);
    None: never save."""
    resume: bool = False
    """Continue from the latest complete checkpoint under ``checkpoint_dir`` when there is one
    (a fresh start otherwise, so one command line serves the first run and every restart). The
    data of step ``s`` is a pure function of ``s``, so a resumed run is bit-identical to an
    uninterrupted one."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept under ``checkpoint_dir``; older ones are deleted after a save
    (two: if the newest turns out damaged, its predecessor is still there)."""
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """Seconds a collective may wait for a peer before the rank gives up with a clear message
    and exit status 75 (``zbuf.faults``); NCCL's own default. It must exceed the longest
    legitimate wait of a fast rank for a slow one: a checkpoint save or a first compile."""

    # ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Machine-independent checks; raises ``ConfigError``."""
        if not self.engines:
            raise ConfigError("no engine selected; pass --engine zbuf|zbuf-eager|fsdp2|ddp")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of "
                              f"{', '.join(PRESETS)}")
        if self.hf_model is not None and not re.fullmatch(r"[a-z0-9_]+", self.hf_model):
            raise ConfigError(f"--model hf:{self.hf_model}: expected a transformers model type "
                              f"such as hf:qwen3 or hf:llama")
        for name in ("layers", "micro_batch", "global_batch", "seq_len", "steps", "nproc"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                                  f"got {v!r}")
        if self.micro_batch is not None and self.global_batch is not None:
            raise ConfigError("give --micro-batch (per rank) or --global-batch (split over the "
                              "ranks), not both")
        if self.seq_len is not None and self.seq_len < 4:
            raise ConfigError(f"--seq-len must be at least 4, got {self.seq_len}")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.mem_frac is not None and not 0.0 < self.mem_frac <= 1.0:
            raise ConfigError(f"--mem-frac must lie in (0, 1] (a fraction of the GPU's memory), "
                              f"got {self.mem_frac}")
        if self.budget is not None and not any(e.uses_zbuf for e in self.engines):
            raise ConfigError("--budget sets the zbuf gather budget; it has no meaning for "
                              f"engine(s) {', '.join(e.value for e in self.engines)}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.compiler not in (None, "inductor", "aot_eager"):
            raise ConfigError(f"--compiler must be inductor or aot_eager, got {self.compiler!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                              f"{self.optimizer!r}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"--peak-tflops must be positive, got {self.peak_tflops}")
        if isinstance(self.collective_timeout_s, bool) or not isinstance(
                self.collective_timeout_s, (int, float)) or not self.collective_timeout_s > 0:
            raise ConfigError(f"--collective-timeout must be a positive number of seconds, got "
                              f"{self.collective_timeout_s!r}")
        self.save_resume_policy()
        if self.checkpoint_dir is not None:
            other = [e.value for e in self.engines if not e.uses_zbuf]
            if other:
                raise ConfigError(
                    f"--checkpoint-dir saves zbuf's sharded checkpoints; engine(s) "
                    f"{', '.join(other)} cannot use them. Use --engine zbuf or zbuf-eager, or "
                    f"drop the checkpoint options")

    def save_resume_policy(self):
        """The ``save_resume.SaveResumePolicy`` of these options (validates them)."""
        from .save_resume import SaveResumePolicy

        try:
            return SaveResumePolicy(self.checkpoint_dir, self.save_every, self.resume,
                                    self.keep_checkpoints)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def resolve(self, *, cuda: bool, world: int, bench: bool) -> "TrainConfig":
        """Fill every ``None`` for this machine and world size; check what depends on them."""
        self.validate()
        c = dataclasses.replace(self)
        c.device = "cuda" if cuda else "cpu"
        c.nproc = world
        c.preset = c.preset or ("qwen3-0.6b" if cuda else "tiny")
        if c.global_batch is not None:
            if c.global_batch < world:
                raise ConfigError(
                    f"{world} ranks but a global batch of {c.global_batch} sequence(s): every "
                    f"rank needs at least one; use --nproc {c.global_batch} or less, or a "
                    f"--global-batch of at least {world}")
            if c.global_batch % world:
                raise ConfigError(
                    f"--global-batch {c.global_batch} does not split evenly over {world} ranks; "
                    f"use a multiple of {world}")
            c.micro_batch = c.global_batch // world
        c.micro_batch = c.micro_batch or (4 if cuda else 8)
        c.global_batch = c.micro_batch * world
        c.seq_len = c.seq_len or (2048 if cuda else 64)
        c.steps = c.steps or 30
        if c.checkpoint_dir is not None:
            if bench:
                raise ConfigError(
                    "zbuf bench compares engines from the same start and keeps no checkpoints; "
                    "use zbuf train --checkpoint-dir DIR for a run that saves and resumes")
            c.checkpoint_dir = os.path.abspath(c.checkpoint_dir)
            if os.path.exists(c.checkpoint_dir) and not os.path.isdir(c.checkpoint_dir):
                raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir}: exists and is not a "
                                  f"directory; give a directory (it is created if missing)")
        if c.save_every is not None and c.save_every > c.steps:
            raise ConfigError(f"--save-every {c.save_every} with --steps {c.steps} never saves; "
                              f"use --save-every {c.steps} or less")
        c.warmup = (10 if bench else 3) if c.warmup is None else c.warmup
        if c.warmup >= c.steps:
            raise ConfigError(f"--warmup {c.warmup} leaves no measured step out of --steps "
                              f"{c.steps}; use more steps or less warm-up")
        c.ac = cuda if c.ac is None else c.ac
        if c.lr is None:
            if c.optimizer == "sgd":
                c.lr = 0.1 if c.preset == "tiny" else 1e-2
            else:
                c.lr = 3e-3 if c.preset == "tiny" else 3e-4
        c.compiler = c.compiler or ("inductor" if cuda else "aot_eager")
        if c.dtype == "auto":
            c.dtype = "bf16" if cuda else "fp32"
        if c.mem_frac is not None and not cuda:
            raise ConfigError("--mem-frac caps GPU memory (torch.cuda."
                              "set_per_process_memory_fraction); this run has no GPU")
        max_seq = PRESETS[c.preset].max_seq_len
        if c.seq_len > max_seq:
            raise ConfigError(f"--seq-len {c.seq_len} exceeds preset {c.preset}'s max_seq_len "
                              f"{max_seq}")
        c.out = c.out or ("zbuf-bench.json" if bench else "zbuf-train.json")
        if c.profile_dir is not None:
            c.profile_dir = os.path.abspath(c.profile_dir)
            if os.path.exists(c.profile_dir) and not os.path.isdir(c.profile_dir):
                raise ConfigError(f"--profile-dir {self.profile_dir}: exists and is not a "
                                  f"directory; give a directory (it is created if missing)")
        return c

    def model_config(self) -> ModelConfig:
        """The model's shape: the preset's, with ``layers`` decoder layers when that is set."""
        mcfg = resolve_config(self.preset)
        return mcfg if self.layers is None else dataclasses.replace(mcfg, num_layers=self.layers)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["engines"] = [e.value for e in self.engines]
        d["task"] = self.task.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        d["engines"] = tuple(Engine(e) for e in d["engines"])
        d["task"] = Task(d["task"])
        return cls(**d)


def check_output_path(path: str) -> str:
    """Absolute path of a JSON record we will be able to write; ``ConfigError`` otherwise."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise ConfigError(f"--out {path}: is a directory; give a file name such as "
                          f"{os.path.join(path, 'run.json')}")
    if not os.path.isdir(parent):
        raise ConfigError(f"--out {path}: directory {parent} does not exist; create it first")
    existed = os.path.exists(full)
    try:  # a real open, not os.access: root passes access checks on read-only file systems
        with open(full, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot write there ({e.strerror}); choose another "
                          f"path") from None
    if not existed:
        os.unlink(full)
    return full
