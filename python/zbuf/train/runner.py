"""``zbuf train`` and ``zbuf bench``: resolve the config, launch, collect, record, summarise.

Launched plainly, each engine runs in a fresh group of worker processes (a clean CUDA context,
allocator and compile cache per engine, so memory and first-step numbers do not depend on what
ran before). Under torchrun the processes are given, so the engines run one after another in
them, with the compile cache reset and device memory emptied in between.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import sys
import tempfile
from typing import Any, Optional

from rich.console import Console

from .config import ConfigError, TrainConfig, check_output_path, format_bytes
from .interrupted import read_stopped
from .launcher import Interrupted, launch_group, under_torchrun
from .progress import comparison_table, print_error, print_table, summary_table
from .record import make_record, markdown, merge_records, simulated_text, write_record
from .refusals import checkpoint_refusal, plan_refusal
from .resources import check_cpu_memory, cpu_oversubscription, host_memory_bytes
from .resume_commands import TORCHRUN, resume_command, resume_from_command

__all__ = ["run", "merge", "prepare"]

_INTERRUPTED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Exit statuses of a run a signal stopped: 130 (Ctrl-C), 143 (SIGTERM)."""


def _machine(cfg: TrainConfig) -> tuple[bool, int]:
    """(use CUDA, world size) for this launch; ``ConfigError`` when they cannot work."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.simulated:  # [Note: simulated ranks]: one process, rank 0 of N
        if under_torchrun():
            raise ConfigError(f"--simulate-world {cfg.simulate_world} runs one process as rank "
                              f"0 of {cfg.simulate_world}; start it without torchrun")
        return cuda, cfg.simulate_world
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if cfg.nproc is not None and cfg.nproc != world:
            raise ConfigError(f"--nproc {cfg.nproc} disagrees with torchrun's world size "
                              f"{world}; drop --nproc under torchrun")
        return cuda, world
    gpus = torch.cuda.device_count() if cuda else 0
    world = cfg.nproc or (gpus if cuda else 2)
    if cuda and world > gpus:
        raise ConfigError(f"--nproc {world} but only {gpus} GPU(s) visible; one rank per GPU")
    return cuda, world


def _emulated_card(cfg: TrainConfig) -> TrainConfig:
    """``--gpu-memory SIZE`` on this machine (resolved ``cfg``): on CUDA the fraction of the card
    torch reports (``mem_frac``, which caps torch's allocator and zbuf's pool together, [Note:
    emulated capacity] in zbuf/memory/shared.py); on CPU the host's memory is the card, and the size
    stays for zbuf's stand-in. ``ConfigError`` for a size above the card."""
    if cfg.gpu_memory is None:
        return cfg
    if cfg.device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        what = f"this GPU's {format_bytes(total)} ({torch.cuda.get_device_name(0)})"
    else:
        total = host_memory_bytes()
        what = f"this machine's {format_bytes(total)} of memory (on CPU the card is the host)"
    if total is not None and cfg.gpu_memory > total:
        raise ConfigError(f"--gpu-memory {format_bytes(cfg.gpu_memory)} is more than {what}: it "
                          f"emulates a smaller card; give at most {format_bytes(total)}")
    if cfg.device == "cuda":
        return dataclasses.replace(cfg, mem_frac=cfg.gpu_memory / total)
    return cfg


def _resume_point(cfg: TrainConfig, argv: Optional[list[str]]) -> int:
    """Check the checkpoint options against the file system before any worker starts; the step
    a ``--resume`` run will continue from (0: a fresh start). ``ConfigError`` if they cannot
    work: a directory that cannot be created or written, another run's checkpoints or settings
    ([Note: checkpoints belong to one run] in save_resume.py), or a checkpoint already past
    ``--steps``. Reads files only (no process group), so every torchrun rank may call it."""
    if cfg.checkpoint_dir is None:
        return 0
    from ..checkpoint import CheckpointError
    from .save_resume import resume_point

    root = cfg.checkpoint_dir
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".zbuf-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {root}: cannot write there ({e.strerror}); choose "
                          f"another directory") from None
    try:
        info = resume_point(cfg.save_resume_policy())
    except CheckpointError as e:
        launcher = TORCHRUN if under_torchrun() else "zbuf"
        raise ConfigError(checkpoint_refusal(e, resume_from_command(argv, launcher))) from None
    if info is None:
        return 0
    if info.step > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint {info.path} is at step {info.step}, past "
                          f"--steps {cfg.steps}; pass --steps {info.step + 1} or more to continue "
                          f"it, or another --checkpoint-dir to start afresh")
    return info.step


def _resumed_out(out: str, start: int) -> str:
    """Where the record of a run resumed at step ``start`` goes when ``out`` exists.

    [Note: a resumed run's record]
    The command that resumes a run is the one that started it plus ``--resume`` (the hint an
    interrupted run prints), so it names the same ``--out``: the resumed run overwrote the
    record of the steps before the interruption, and steps 1-70 of a run resumed there were in
    no record. A resumed run whose ``--out`` exists writes beside it instead, to
    ``<name>.from-step-<start>.json`` (``.from-step-<start>-2.json`` when that exists too), and
    says so; the two records together hold every step."""
    stem, ext = os.path.splitext(out)
    candidate, n = f"{stem}.from-step-{start}{ext or '.json'}", 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{stem}.from-step-{start}-{n}{ext or '.json'}"
    return candidate


def _failure(cfg: TrainConfig, index: int, status: str, error: str) -> dict[str, Any]:
    engine, mode = cfg.runs()[index]
    return {"engine": engine.value, "label": cfg.run_labels()[index], "ac": mode,
            "status": status, "error": error}


def _interrupted_partial(cfg: TrainConfig, index: int, path: str) -> dict:
    """What the ranks wrote of an interrupted run ([Note: every rank's stopped steps] in
    ``interrupted``), or a record entry saying it stopped before a step finished."""
    partial = read_stopped(path, cfg.processes)
    if partial is not None:
        return partial
    return {"engines": [_failure(cfg, index, "interrupted", "interrupted before any step "
                                                              "finished")]}


def _last_line(text: str) -> str:
    return next((line for line in reversed(text.splitlines()) if line.strip()), "")


def _spawned(command: str, cfg: TrainConfig, index: int, console: Console,
             argv: Optional[list[str]]) -> tuple[dict, int, list[str]]:
    """Run one engine (run ``index`` of ``cfg.runs()``) in a fresh worker group; (partial
    record, exit code, how the ranks ended: one line per distinct cause, [Note: one line per
    cause] in ``launcher``)."""
    with tempfile.TemporaryDirectory(prefix="zbuf-run-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        partial_path = os.path.join(tmp, "partial.json")
        threads = max(1, (os.cpu_count() or 2) // cfg.processes)
        with open(spec_path, "w") as f:
            json.dump({"config": cfg.to_json(), "runs": [index], "partial": partial_path,
                       "threads": threads, "command": command, "argv": argv}, f)
        env = dict(os.environ)
        if cfg.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            group = launch_group(["-m", "zbuf.train.worker", spec_path], cfg.processes, env=env)
        except Interrupted as e:  # every worker has stopped; rank 0 left the steps it did
            return (_interrupted_partial(cfg, index, partial_path), e.exit_code,
                    [f"interrupted ({e})"])
        rank = group.failed_rank
        stops = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM"}
        if rank is not None and group.returncodes[rank] in stops:  # it reached the ranks only
            code = group.returncodes[rank]
            return _interrupted_partial(cfg, index, partial_path), code, \
                [f"interrupted ({stops[code]})"]
        if group.failed_rank is None and os.path.exists(partial_path):
            with open(partial_path) as f:
                return json.load(f), 0, []
        rank = group.failed_rank
        if rank is None:  # every rank exited 0 but rank 0 wrote no record
            msg = "the ranks exited without a record (rank 0 wrote none)"
            return {"engines": [_failure(cfg, index, "failed", msg)]}, 1, [msg]
        texts = {}
        for r in range(cfg.processes):
            err = f"{partial_path}.rank{r}.err"  # written by worker.main
            if os.path.exists(err):
                with open(err) as f:
                    texts[r] = f.read()
        causes = group.causes({r: _last_line(t) for r, t in texts.items() if t.strip()})
        msg = texts.get(rank) or f"rank {rank} {group.describe(rank)} and left no traceback"
        code = group.returncodes[rank]
        if code == 1 and texts.get(rank):  # a Python exception: its traceback, once
            print(texts[rank].rstrip(), file=sys.stderr, flush=True)
        partial = read_stopped(partial_path, cfg.processes)  # [Note: interrupted runs] in loop
        if partial is None:
            partial = {"engines": [_failure(cfg, index, "failed", msg)]}
        else:
            partial["engines"][-1].update(status="failed", error=msg)
        return partial, code if code > 0 else 1, causes


def prepare(cfg: TrainConfig, *, bench: bool) -> TrainConfig:
    """``cfg`` validated and resolved for this machine, its output path checked: everything
    that can refuse the options before a worker starts (``ConfigError``)."""
    cfg.validate()
    cuda, world = _machine(cfg)
    cfg = _emulated_card(cfg.resolve(cuda=cuda, world=world, bench=bench))
    if not cuda and not under_torchrun():  # ranks we would start: can the machine hold them?
        check_cpu_memory(cfg)
    if not under_torchrun() or os.environ["RANK"] == "0":  # only rank 0 writes it
        cfg.out = check_output_path(cfg.out)
    return cfg


def run(command: str, cfg: TrainConfig, console: Console | None = None,
        argv: Optional[list[str]] = None) -> int:
    """Exit status: 0 when every engine ran, 1 when one failed, 2 on a bad option, 130 on
    SIGINT (Ctrl-C), 143 on SIGTERM. ``argv``: the command's arguments (``train ...``), for the
    commands that resume a run."""
    console = console or Console()
    bench = command == "bench"
    try:
        cfg = prepare(cfg, bench=bench)
        start = _resume_point(cfg, argv)
        crowded = None if cfg.device == "cuda" or under_torchrun() else cpu_oversubscription(cfg)
    except ConfigError as e:
        if not under_torchrun() or os.environ.get("RANK") == "0":
            print_error(command, str(e))
        return 2

    if start == cfg.steps:
        # A restart of a finished run (a requeued job): nothing to do, and that is success.
        if not under_torchrun() or os.environ.get("RANK") == "0":
            console.print(f"zbuf {command}: the latest checkpoint under {cfg.checkpoint_dir} is "
                          f"at step {start} = --steps; nothing to train (raise --steps to "
                          f"continue)", highlight=False, markup=False)
        return 0
    if start and os.path.exists(cfg.out):  # [Note: a resumed run's record]
        kept, cfg = cfg.out, dataclasses.replace(cfg, out=_resumed_out(cfg.out, start))
        if not under_torchrun() or os.environ.get("RANK") == "0":
            console.print(f"zbuf {command}: note: resuming at step {start}; {kept} keeps the "
                          f"record it holds, and this run's record goes to {cfg.out}",
                          highlight=False, markup=False, soft_wrap=True)
    if under_torchrun():
        return _run_in_process(command, cfg, console, argv)
    if crowded is not None:  # [Note: CPU ranks and cores] in resources
        console.print(f"zbuf {command}: note: {crowded}", highlight=False, markup=False,
                      soft_wrap=True)

    engines_out: list[dict] = []
    env: dict = {}
    peak = None
    status = 0
    for index, label in enumerate(cfg.run_labels()):
        partial, code, causes = _spawned(command, cfg, index, console, argv)
        env = partial.get("environment", env)
        peak = partial.get("peak_flops", peak)
        engines_out.extend(partial["engines"])
        if code in _INTERRUPTED:
            print_error(command, f"{causes[0]}; all workers stopped")
            status = code
            break
        if code == 2:  # the workers refused the input (refusals.py); rank 0 said why, once
            status = 2
            if not bench:
                break
        elif code:
            status = 1
            print_error(command, f"engine {label} failed (exit {code}): {causes[0]}")
            for line in causes[1:]:  # [Note: one line per cause] in launcher
                print_error(command, f"  also {line}")
            if not bench:
                break
    if status in (2, *_INTERRUPTED) and not any(e.get("steps") for e in engines_out):
        # Refused or stopped before any step finished: nothing ran that a record could hold,
        # and --out (perhaps an earlier run's record) stays as it was.
        if status != 2:
            console.print(f"no step finished; no record written to {cfg.out}", highlight=False,
                          markup=False, soft_wrap=True)
            _resume_hint(cfg, argv, console)
        return status
    if not env:  # no worker reported: describe the machine the run was for, from here
        import torch

        from .metrics import environment, peak_flops_per_second

        device = torch.device(cfg.device)  # the workers have exited: a CUDA context here is free
        env = environment(device)
        peak = peak_flops_per_second(device, cfg.peak_tflops, cfg.dtype)
    code = _finish(command, cfg, env, engines_out, peak, console) or status
    if status in _INTERRUPTED:
        _resume_hint(cfg, argv, console)
    return code


def _resume_hint(cfg: TrainConfig, argv: Optional[list[str]], console: Console,
                 launcher: str = "zbuf") -> None:
    """After an interrupt: the checkpoint a resume would continue from, and the command
    (``launcher`` and ``argv``)."""
    if cfg.checkpoint_dir is None:
        return
    from ..checkpoint import list_checkpoints

    found = list_checkpoints(cfg.checkpoint_dir)
    if not found:
        console.print(f"no checkpoint was written yet under {cfg.checkpoint_dir}", highlight=False,
                      markup=False)
        return
    step, path = found[-1]
    console.print(f"latest checkpoint: {path} (step {step})", highlight=False, markup=False,
                  soft_wrap=True)
    if argv:
        console.print(f"resume with: {resume_command(argv, launcher)}", highlight=False,
                      markup=False, soft_wrap=True)


def _run_in_process(command: str, cfg: TrainConfig, console: Console,
                    argv: Optional[list[str]] = None) -> int:
    from .. import faults
    from ..checkpoint import CheckpointError
    from ..compile import PlanExceedsMemoryError
    from .worker import run_engines

    rank = int(os.environ["RANK"])
    # [Note: what a stop leaves unsaid] in zbuf/faults.py
    with tempfile.TemporaryDirectory(prefix="zbuf-run-") as tmp, faults.unsaid_stop_noise():
        stopped = os.path.join(tmp, "interrupted.json")  # [Note: interrupted runs] in loop
        try:
            # Releases the pools and the process group on every way out.
            with faults.supervised(cli=True):
                partial = run_engines(cfg, tuple(range(len(cfg.engines))), cfg.progress,
                                      stopped_path=stopped)
        except (CheckpointError, PlanExceedsMemoryError) as e:  # alike on every rank: once
            if rank == 0:
                print_error(command, checkpoint_refusal(e, resume_from_command(argv, TORCHRUN))
                            if isinstance(e, CheckpointError) else plan_refusal(cfg, e))
            return 2
        except SystemExit as e:  # Ctrl-C (130) or torchrun's SIGTERM (143), after release
            if rank != 0 or e.code not in (130, 143):
                raise
            how = "SIGINT" if e.code == 130 else "SIGTERM"
            if not os.path.exists(stopped):  # stopped before a step finished: say so
                print_error(command, f"interrupted ({how}) before a step finished; no record "
                                     f"written to {cfg.out}")
                _resume_hint(cfg, argv, console, launcher=TORCHRUN)
                return e.code
            with open(stopped) as f:
                partial = json.load(f)
            print_error(command, f"interrupted ({how}); the record holds the steps done")
            _finish(command, cfg, partial["environment"], partial["engines"],
                    partial["peak_flops"], console)
            _resume_hint(cfg, argv, console, launcher=TORCHRUN)
            return e.code
    if rank != 0:
        return 0
    return _finish(command, cfg, partial["environment"], partial["engines"], partial["peak_flops"],
                   console)


def _finish(command: str, cfg: TrainConfig, env: dict, engines: list[dict], peak,
            console: Console) -> int:
    record = make_record(command, cfg, env, engines, peak)
    write_record(record, cfg.out)
    if any(e.get("summary") for e in engines):  # else a table of dashes: the error said it all
        print_table(console, summary_table(record))
    table = comparison_table(record)
    if table is not None:
        console.print(table)
    sim = simulated_text(record)
    if sim:
        console.print(sim, highlight=False, markup=False, soft_wrap=True)
    for eng in engines:
        for text in eng.get("notices", []):
            console.print(f"note ({eng['engine']}): {text}", highlight=False, markup=False,
                          soft_wrap=True)
    if command == "bench":
        md_path = os.path.splitext(cfg.out)[0] + ".md"
        with open(md_path, "w") as f:
            f.write(markdown(record))
        console.print(f"record: {cfg.out}\ntable:  {md_path}", highlight=False, soft_wrap=True)
    elif all(e.get("status") == "ok" for e in engines):
        # A line of its own, never wrapped: a command to copy whole, whatever the path's length.
        console.print(f"record: {cfg.out}\nplots:  zbuf report {shlex.quote(cfg.out)}",
                      highlight=False, soft_wrap=True)
    else:  # nothing to plot; the record holds the error
        console.print(f"record: {cfg.out}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return 0


def merge(paths: list[str], out: str, console: Console | None = None) -> int:
    """``zbuf bench --merge``: one comparison from records of the same configuration."""
    console = console or Console()
    try:
        out = check_output_path(out)
        record = merge_records(paths)
    except FileNotFoundError as e:
        print_error("bench", f"no such file: {e.filename}")
        return 2
    except (ConfigError, ValueError, KeyError) as e:
        print_error("bench", str(e))
        return 2
    write_record(record, out)
    md_path = os.path.splitext(out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(markdown(record))
    print_table(console, summary_table(record))
    table = comparison_table(record)
    if table is not None:
        console.print(table)
    console.print(f"record: {out}\ntable:  {md_path}", highlight=False)
    return 0
