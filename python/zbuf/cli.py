"""The ``zbuf`` command: ``zbuf train``, ``zbuf bench``, ``zbuf fit``, ``zbuf report``.

    zbuf train                      # CPU: 2 gloo ranks, tiny preset; GPU: every GPU over NCCL
    zbuf train --engine fsdp2 --preset qwen3-1.7b --micro-batch 4 --seq-len 4096 --ac
    zbuf train --checkpoint-dir ckpt --save-every 100 --resume   # same line starts and restarts
    zbuf bench --engines zbuf,fsdp2,ddp --preset qwen3-8b --mem-frac 0.68
    zbuf bench --engines zbuf:auto,fsdp2:full,fsdp2:selective --preset qwen3-8b
    zbuf bench --engines zbuf,fsdp2 --preset qwen3-14b --simulate-world 8 --gpu-memory 80GiB
    zbuf fit --preset qwen3-8b --simulate-world 8 --gpu-memory 80GiB --seq-len 4096 --ac
    zbuf report zbuf-train.json -o plots/
    torchrun --nproc_per_node 8 -m zbuf.cli train ...   # multi-node / external launcher

The machinery lives in ``zbuf.train``; this module only parses options, and those of
``TrainConfig`` come from its fields ([Note: one definition per option] in train/options.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
from typing import Optional

from .train.config import AC_CHOICES, FIT_STEPS, Engine, Task, TrainConfig
from .train.errors import ConfigError, print_error
from .train.options import POSITIVE_INT, SECONDS, cli_option

__all__ = ["main", "build_parser"]

_ENGINES = [e.value for e in Engine]
_GROUPS = {"model": "model", "training": "training", "system": "system", "output": None,
           "checkpoints": "checkpoints and faults (zbuf engines)"}
"""``CliOption.group`` -> the ``--help`` section it goes in (None: the command's own)."""


class _Parser(argparse.ArgumentParser):
    """An argparse error is one line and exit status 2: ``zbuf train: error: ...``, without the
    usage block before it (``zbuf train --help`` shows that)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = re.sub(r"^argument (\S+): \1\b", r"\1", message)  # the check named it
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_RETIRED = types.MappingProxyType({
    "--budget": "--budget was split in two: --gather-budget SIZE bounds engine zbuf's gathered "
                "bytes, --pool-budget SIZE caps engine zbuf-eager's gather-buffer pool",
})
"""Flags that no longer exist -> the one line that says what replaced them (argparse alone
would answer "unrecognized arguments", which names no replacement)."""


class _Retired(argparse.Action):
    """A retired flag, hidden from ``--help``: using it is an error naming its replacement."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(_RETIRED[option_string])


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


def _reader(check, flag: str):
    """argparse ``type=`` of a checked option: the field's own check ([Note: one definition per
    option] in zbuf/train/options.py)."""

    def read(text: str):
        try:
            return check.parse(flag, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = flag  # argparse names the type in some messages
    return read


def _add_config_options(p: argparse.ArgumentParser, command: str) -> None:
    """Every ``TrainConfig`` field with a ``CliOption`` for ``command``, in field order."""
    groups: dict[str, argparse._ArgumentGroup] = {}

    def group(name: str):
        title = _GROUPS[name]
        if title is None:
            return p
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        return groups[title]

    if command in ("train", "bench", "fit"):
        m = group("model")
        m.add_argument("--model", metavar="hf:TYPE|PRESET",
                       help="hf:qwen3 or hf:llama builds that transformers causal LM with the "
                            "preset's shape and random weights, no download (needs pip install "
                            "'zbuf[hf]'); a plain name is the same as --preset")
    for f in dataclasses.fields(TrainConfig):
        opt = cli_option(f)
        if opt is None or command not in opt.commands:
            continue
        flag = opt.flag_of(f.name)
        kwargs = dict(opt.argparse)
        action = kwargs.get("action")
        if action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
        if opt.check is not None:
            kwargs["type"] = _reader(opt.check, flag)
        if opt.choices is not None:
            kwargs["choices"] = list(opt.choices)
        if opt.metavar is not None:
            kwargs["metavar"] = opt.metavar
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs["default"] = getattr(default, "value", default)
        group(opt.group).add_argument(flag, dest=f.name, help=opt.help_for.get(command, opt.help),
                                      **kwargs)
        if f.name == "ac":
            group(opt.group).add_argument("--no-ac", dest="ac", action="store_const",
                                          const="off", help="no activation checkpointing (same "
                                                            "as --ac off)")
    for flag in _RETIRED:  # nargs="?": the bare flag and --flag=VALUE get the same line
        p.add_argument(flag, action=_Retired, nargs="?", dest=argparse.SUPPRESS,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _add_engine(p: argparse.ArgumentParser) -> None:
    """``--engine``: the one engine of ``zbuf train`` and ``zbuf fit`` (bench: ``--engines``)."""
    p.add_argument("--engine", choices=_ENGINES, default=Engine.ZBUF.value,
                   help="zbuf (sharded + compiled, default), zbuf-eager, fsdp2, ddp")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zbuf", description="ZeRO-3 training for torch.compile: train, "
                                              "benchmark, report.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{train,bench,fit,report}", parser_class=_Parser)
    train = sub.add_parser("train", help="train the built-in decoder",
                           description="Train the built-in decoder on a synthetic task.")
    _add_engine(train)
    _add_config_options(train, "train")
    bench = sub.add_parser("bench", help="one configuration under several engines",
                           description="Run one configuration under several engines, side by "
                                       "side, and compare.")
    bench.add_argument("--engines", type=_engine_list,
                       default=tuple((e, None) for e in (Engine.ZBUF, Engine.ZBUF_EAGER,
                                                         Engine.FSDP2, Engine.DDP)),
                       help="comma-separated, in run order (default zbuf,zbuf-eager,fsdp2,ddp); "
                            "ENGINE:MODE gives one engine its own --ac mode, e.g. "
                            "zbuf:auto,fsdp2:full,fsdp2:selective")
    bench.add_argument("--merge", nargs="+", metavar="RUN.json",
                       help="run nothing: merge these records of one configuration (e.g. one "
                            "engine per job) into --out and its markdown table")
    _add_config_options(bench, "bench")
    fit = sub.add_parser("fit", help="the largest micro-batch that fits a card, by simulated "
                                     "steps", description="Find the largest micro-batch that "
                         "trains without OOM and without allocator retries after warm-up on a "
                         "card of --gpu-memory, as rank 0 of --simulate-world ranks: a bisection "
                         "of simulated runs, each probe its own process with a time limit.")
    _add_engine(fit)
    fit.add_argument("--max-micro-batch", type=_reader(POSITIVE_INT, "--max-micro-batch"),
                     default=64, metavar="N", help="largest micro-batch tried (default 64)")
    fit.add_argument("--min-micro-batch", type=_reader(POSITIVE_INT, "--min-micro-batch"),
                     default=1, metavar="N", help="the search doubles from here (default 1; "
                                                  "bisects below it if it does not fit)")
    fit.add_argument("--probe-timeout", type=_reader(SECONDS, "--probe-timeout"), default=540.0,
                     metavar="SECONDS", help="a probe that has not finished by then counts as "
                                             "not fitting (default 540)")
    _add_config_options(fit, "fit")
    report = sub.add_parser("report", help="plots and the schedule table of a run record",
                            description="Write PNG plots of a run record and print its "
                                        "schedule.")
    report.add_argument("record", metavar="RUN.json")
    report.add_argument("-o", "--out-dir", default=None,
                        help="directory for the PNGs (default: next to the record)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``zbuf train`` / ``zbuf bench`` options: every field the
    command has an option for, plus what ``--model`` and ``--engine(s)`` stand for."""
    preset, hf = args.preset, None
    if args.model:
        if args.model.startswith("hf:"):
            hf = args.model[3:]
        elif preset and preset != args.model:
            raise ConfigError(f"--model {args.model} and --preset {preset} disagree; give one")
        else:
            preset = args.model
    runs = args.engines if args.command == "bench" else ((Engine(args.engine), None),)
    if args.command == "fit":
        args.steps = args.steps or FIT_STEPS
        args.out = args.out or "zbuf-fit.json"
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if cli_option(f) is not None and hasattr(args, f.name)}
    fields.update(preset=preset, hf_model=hf, engines=tuple(e for e, _ in runs),
                  engine_ac=tuple(m for _, m in runs) if any(m for _, m in runs) else ())
    fields["task"] = Task(fields["task"])
    if fields.get("resume_from") is not None:
        fields["resume"] = True
    return TrainConfig(**fields)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from .train.report import main as report_main

        return report_main(args.record, args.out_dir)
    if args.command == "bench" and args.merge:
        from .train.runner import merge

        return merge(args.merge, args.out or "zbuf-bench.json")

    try:
        cfg = config_from_args(args)
        # The checks that need no machine, before anything imports torch (seconds): a bad
        # option is refused in a fraction of a second (issue 37, item 13).
        cfg.validate()
    except ConfigError as e:
        print_error(args.command, str(e))
        return 2
    if args.command == "fit":
        from .train.fit import main as fit_main

        return fit_main(cfg, max_micro_batch=args.max_micro_batch, timeout_s=args.probe_timeout,
                        min_micro_batch=args.min_micro_batch)
    from .train.runner import run

    return run(args.command, cfg, argv=list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    code = main()
    if "torch" in sys.modules:  # under torchrun this process was a rank: [Note: worker teardown order]
        from .faults import end_process

        end_process(code)
    sys.exit(code)
