"""The ``zbuf`` command: ``zbuf train``, ``zbuf bench``, ``zbuf report``.

    zbuf train                      # CPU: 2 gloo ranks, tiny preset; GPU: every GPU over NCCL
    zbuf train --engine fsdp2 --preset qwen3-1.7b --micro-batch 4 --seq-len 4096 --ac
    zbuf train --checkpoint-dir ckpt --save-every 100 --resume   # same line starts and restarts
    zbuf bench --engines zbuf,fsdp2,ddp --preset qwen3-8b --mem-frac 0.68
    zbuf bench --engines zbuf:auto,fsdp2:full,fsdp2:selective --preset qwen3-8b
    zbuf report zbuf-train.json -o plots/
    torchrun --nproc_per_node 8 -m zbuf.cli train ...   # multi-node / external launcher

The machinery lives in ``zbuf.train``; this module only parses options.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .train.config import (
    AC_CHOICES,
    OPTIMIZERS,
    RUN_DEFINING,
    ConfigError,
    Engine,
    Task,
    TrainConfig,
    parse_bytes,
)

__all__ = ["main", "build_parser"]

_ENGINES = [e.value for e in Engine]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"{value} is out of range: a fraction of the GPU's memory in (0, 1], e.g. 0.68")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _engine_list(text: str) -> tuple[tuple[Engine, Optional[str]], ...]:
    """``zbuf,fsdp2:selective`` -> ((zbuf, None), (fsdp2, "selective")): engines, each with an
    optional activation checkpointing mode that overrides ``--ac``."""
    specs = [t.strip() for t in text.split(",") if t.strip()]
    pairs = [(n.strip(), m.strip() or None) for n, _, m in (t.partition(":") for t in specs)]
    bad = [n for n, _ in pairs if n not in _ENGINES]
    if bad or not pairs:
        raise argparse.ArgumentTypeError(
            f"unknown engine(s) {', '.join(bad) or '(none)'}; choose from {', '.join(_ENGINES)}")
    bad = [m for _, m in pairs if m is not None and m not in AC_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown activation checkpointing mode(s) {', '.join(bad)} in {text!r}; write "
            f"ENGINE:MODE with MODE one of {', '.join(AC_CHOICES)}")
    if len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(f"engine listed twice in {text!r}")
    return tuple((Engine(n), m) for n, m in pairs)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--preset", help="built-in model preset: tiny, qwen3-0.6b, qwen3-1.7b, "
                                    "qwen3-4b, qwen3-8b, qwen3-14b (default: tiny on CPU, "
                                    "qwen3-0.6b on GPU)")
    m.add_argument("--model", metavar="hf:TYPE|PRESET",
                   help="hf:qwen3 or hf:llama builds that transformers causal LM with the "
                        "preset's shape and random weights, no download (needs pip install "
                        "'zbuf[hf]'); a plain name is the same as --preset")
    m.add_argument("--layers", type=_positive_int, metavar="N",
                   help="N decoder layers of the preset's shape instead of its own count (a "
                        "large preset's harness on fewer GPUs)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch", type=_positive_int, help="sequences per rank per step "
                   "(default 8 on CPU, 4 on GPU)")
    t.add_argument("--global-batch", type=_positive_int,
                   help="sequences per step over all ranks, split evenly (instead of "
                        "--micro-batch)")
    t.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (default 64 on "
                   "CPU, 2048 on GPU)")
    t.add_argument("--steps", type=_positive_int, help="steps per engine, warm-up included "
                   "(default 30)")
    t.add_argument("--warmup", type=int, help="steps left out of the timing statistics "
                   "(default: train 3, bench 10, at most half of --steps)")
    t.add_argument("--ac", nargs="?", const="full", choices=AC_CHOICES, metavar="MODE",
                   help="activation checkpointing of every block: full (the default of a bare "
                        "--ac: recompute each block), selective (torchtitan's op-level policy), "
                        "auto (engine zbuf: keep what fits in the memory budget, recompute the "
                        "rest) or off (default: full with GPUs, off on CPU)")
    t.add_argument("--no-ac", dest="ac", action="store_const", const="off",
                   help="no activation checkpointing (same as --ac off)")
    t.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="adamw (torch's default: foreach on GPU), adamw-fused or sgd (momentum "
                        "0.9); the same for every engine (default adamw)")
    t.add_argument("--lr", type=float, help="learning rate (AdamW: default 3e-3 for tiny, "
                   "3e-4 for the Qwen3 presets; SGD: 0.1 for tiny, 1e-2 for Qwen3)")
    t.add_argument("--task", choices=[x.value for x in Task], default=Task.STRIDE.value,
                   help="synthetic task (default stride: learnable in tens of steps)")
    t.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    t.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype; master weights stay fp32 (default: bf16 on GPU, fp32 "
                        "on CPU)")
    s = p.add_argument_group("system")
    s.add_argument("--budget", type=_bytes, help="zbuf gather budget, e.g. 8GiB (default: "
                   "from rank-agreed free memory)")
    s.add_argument("--mem-frac", type=_fraction, help="cap usable GPU memory to this fraction "
                   "(emulates a smaller GPU)")
    s.add_argument("--nproc", type=_positive_int, help="ranks to start (default: every GPU, "
                   "or 2 on CPU)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--compiler", choices=["inductor", "aot_eager"],
                   help="what compiles the graphs (default: inductor on GPU, aot_eager on CPU)")
    s.add_argument("--compile-blocks-once", action=argparse.BooleanOptionalAction,
                   default=None, help="zbuf engine: compile each repeated block once, gathers "
                   "in the outer graph (default: on)")
    s.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per GPU for MFU "
                   "(default: from the GPU name)")
    s.add_argument("--profile-dir", metavar="DIR", help="after the measured steps, profile 2 "
                   "more per engine with torch.profiler: each rank's trace and a summary of "
                   "exposed communication go to DIR")
    s.add_argument("--no-progress", action="store_true", help="no live progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zbuf", description="ZeRO-3 training for "
                                     "torch.compile: train, benchmark, report.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,bench,report}")
    train = sub.add_parser("train", help="train the built-in decoder",
                           description="Train the built-in decoder on a synthetic task.")
    train.add_argument("--engine", choices=_ENGINES, default=Engine.ZBUF.value,
                       help="zbuf (sharded + compiled, default), zbuf-eager, fsdp2, ddp")
    train.add_argument("--out", metavar="RUN.json", help="JSON record (default "
                       "zbuf-train.json)")
    _add_run_options(train)
    c = train.add_argument_group("checkpoints and faults (zbuf engines)")
    c.add_argument("--checkpoint-dir", metavar="DIR",
                   help="root of sharded step_<N> checkpoints of one run (created if missing; "
                        "the run's last 2 are kept; a new run needs a directory without "
                        "checkpoints)")
    c.add_argument("--save-every", type=_positive_int, metavar="N",
                   help="save a checkpoint after every N steps and at the last step (needs "
                        "--checkpoint-dir)")
    c.add_argument("--resume", action="store_true",
                   help="continue the run whose checkpoints are in --checkpoint-dir from its "
                        "latest complete one, if any (bit-identical to an uninterrupted run); "
                        "refused if that run's settings differ from these")
    c.add_argument("--resume-from", metavar="step_N",
                   help="like --resume, from this older checkpoint (e.g. step_00000005 or 5): "
                        "the way back when the newest is damaged; the run's later checkpoints "
                        "move to DIR/superseded/")
    c.add_argument("--allow-change", type=_name_list, metavar="SETTING,...", default=(),
                   help="resume although these settings differ from the checkpoint's run, on "
                        f"purpose (e.g. lr); any of {','.join(RUN_DEFINING)}")
    c.add_argument("--collective-timeout", type=_positive_float, metavar="SECONDS",
                   help="a rank waiting longer than this for a peer stops with a clear message "
                        "and exit status 75 (default 600; raise it if saves or first compiles "
                        "take longer)")
    bench = sub.add_parser("bench", help="one configuration under several engines",
                           description="Run one configuration under several engines, side by "
                                       "side, and compare.")
    bench.add_argument("--engines", type=_engine_list,
                       default=tuple((e, None) for e in (Engine.ZBUF, Engine.ZBUF_EAGER,
                                                         Engine.FSDP2, Engine.DDP)),
                       help="comma-separated, in run order (default zbuf,zbuf-eager,fsdp2,ddp); "
                            "ENGINE:MODE gives one engine its own --ac mode, e.g. "
                            "zbuf:auto,fsdp2:full,fsdp2:selective")
    bench.add_argument("--out", metavar="RUN.json", help="JSON record (default "
                       "zbuf-bench.json; the markdown table goes next to it as .md)")
    bench.add_argument("--merge", nargs="+", metavar="RUN.json",
                       help="run nothing: merge these records of one configuration (e.g. one "
                            "engine per job) into --out and its markdown table")
    _add_run_options(bench)
    report = sub.add_parser("report", help="plots and the schedule table of a run record",
                            description="Write PNG plots of a run record and print its "
                                        "schedule.")
    report.add_argument("record", metavar="RUN.json")
    report.add_argument("-o", "--out-dir", default=None,
                        help="directory for the PNGs (default: next to the record)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    preset, hf = args.preset, None
    if args.model:
        if args.model.startswith("hf:"):
            hf = args.model[3:]
        elif preset and preset != args.model:
            raise ConfigError(f"--model {args.model} and --preset {preset} disagree; give one")
        else:
            preset = args.model
    runs = args.engines if args.command == "bench" else ((Engine(args.engine), None),)
    engines = tuple(e for e, _ in runs)
    engine_ac = tuple(m for _, m in runs) if any(m for _, m in runs) else ()
    train = args.command == "train"  # checkpoint and timeout options exist on train only
    return TrainConfig(
        engines=engines, engine_ac=engine_ac, preset=preset, hf_model=hf, layers=args.layers,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch, seq_len=args.seq_len, steps=args.steps,
        warmup=args.warmup, ac=args.ac, budget=args.budget, mem_frac=args.mem_frac,
        seed=args.seed, nproc=args.nproc, out=args.out, dtype=args.dtype,
        compiler=args.compiler, compile_blocks_once=args.compile_blocks_once,
        optimizer=args.optimizer, lr=args.lr, task=Task(args.task),
        device=args.device,
        peak_tflops=args.peak_tflops, profile_dir=args.profile_dir,
        progress=not args.no_progress,
        checkpoint_dir=args.checkpoint_dir if train else None,
        save_every=args.save_every if train else None,
        resume=train and (args.resume or args.resume_from is not None),
        resume_from=args.resume_from if train else None,
        allow_change=args.allow_change if train else (),
        **({"collective_timeout_s": args.collective_timeout}
           if train and args.collective_timeout is not None else {}))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from .train.report import main as report_main

        return report_main(args.record, args.out_dir)
    from .train.progress import print_error
    from .train.runner import merge, run

    if args.command == "bench" and args.merge:
        return merge(args.merge, args.out or "zbuf-bench.json")

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print_error(args.command, str(e))
        return 2
    return run(args.command, cfg, argv=list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    code = main()
    if "torch" in sys.modules:  # under torchrun this process was a rank: [Note: worker teardown order]
        from .faults import end_process

        end_process(code)
    sys.exit(code)
