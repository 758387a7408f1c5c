"""One rank: join the process group, run the engines, hand rank 0's results back.

Entry points: ``python -m zbuf.train.worker SPEC.json`` (started by ``launcher.launch_group``),
or ``run_engines`` called in-process when the CLI itself runs under torchrun. Both run it inside
``zbuf.faults.supervised()``: a dead or stuck peer ends the rank within ``--collective-timeout``
with one clear line and exit status 75, and every exit path releases the pools and the process
group ([Note: rank-failure exit] in ``zbuf/faults.py``).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import faults
from ..checkpoint import CheckpointError
from ..compile import PlanExceedsMemoryError
from ..memory import expand_torch_segments
from .config import TrainConfig
from .interrupted import rank_path
from .launcher import die_with_parent
from .loop import run_engine
from .metrics import environment, peak_flops_per_second
from .progress import NullProgress, TrainProgress
from .refusals import checkpoint_refusal, plan_refusal
from .resume_commands import resume_from_command
from .simulate import init_fake_group

__all__ = ["run_engines", "main"]


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(cfg: TrainConfig) -> torch.device:
    """Join the default process group (NCCL on GPU, gloo on CPU) from the torchrun env; with
    ``--simulate-world N``, be rank 0 of N over torch's fake group.

    Rendezvous keeps a fixed 10 minutes (slow process start-up is not a dead peer); the
    collectives after it get ``cfg.collective_timeout_s``.
    """
    device = _device(cfg)
    if cfg.simulated and not dist.is_initialized():
        init_fake_group(cfg.simulate_world)  # [Note: simulated ranks]
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                timeout=timedelta(minutes=10))
    if not cfg.simulated:  # the fake group has no peers to wait for (and no timeout to set)
        faults.configure_timeout(cfg.collective_timeout_s)
    if dist.get_world_size() != cfg.nproc:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks, config expects "
                           f"{cfg.nproc}")
    return device


def run_engines(cfg: TrainConfig, runs: tuple[int, ...], progress: bool = True,
                stopped_path: Optional[str] = None) -> dict[str, Any]:
    """Run ``cfg``'s runs of these indices (``TrainConfig.runs``) one after another on this rank;
    returns the partial record (all ranks). ``stopped_path``: where the ranks write the partial
    record of the steps done when Ctrl-C or SIGTERM stops it ([Note: interrupted runs] in
    ``loop``)."""
    # Before any engine allocates: every engine, FSDP2's and DDP's too, runs in its best
    # configuration ([Note: torch's allocator grows in place] in zbuf/memory/shared.py).
    allocator = expand_torch_segments() if cfg.device == "cuda" else None
    device = init_distributed(cfg)
    rank = dist.get_rank()
    shown = TrainProgress(memory_label="mem" if device.type == "cuda" else "rss") \
        if rank == 0 and progress else NullProgress()
    results = []
    labels = cfg.run_labels()
    for i in runs:
        torch._dynamo.reset()  # compiled code of a previous engine must not leak into this one
        engine, _ = cfg.runs()[i]
        results.append(run_engine(engine, cfg.for_run(i), device, shown, labels[i],
                                  on_stop=_stopped_writer(cfg, device, results, stopped_path)))
    # [Note: worker teardown order]
    # run_engine dropped the model and optimizer; compiled code can still reference a model (a
    # DDP wrapper holds its group strongly), so it goes too, and the collector frees what cycles
    # kept, all before the caller destroys the process group. Then destroy frees the groups and
    # joins gloo's threads while the interpreter is whole ([Note: a model does not keep its
    # group alive] in zbuf/shard_state.py). What torch itself keeps (FSDP2's mesh, in DTensor's
    # caches) outlives destroy; faults.end_process then ends the process without the
    # finalisation those threads can crash.
    torch._dynamo.reset()
    gc.collect()
    env = environment(device)
    env["collective_timeout_s"] = faults.collective_timeout_s()  # what the ranks really applied
    env["torch_allocator"] = allocator
    return {
        "environment": env,
        "peak_flops": peak_flops_per_second(device, cfg.peak_tflops, cfg.dtype),
        "engines": results,
    }


def _stopped_writer(cfg: TrainConfig, device: torch.device, done: list[dict],
                    path: Optional[str]) -> Optional[Callable[[dict], None]]:
    """A rank's ``on_stop``: the runs done and the interrupted or failed one, as a partial record
    at ``path`` (rank 0) or ``interrupted.rank_path(path, rank)`` (the others, for the launcher
    to join: [Note: interrupted runs] in ``loop``). The rank is stopping: a second Ctrl-C, or
    the launcher's SIGTERM, must not cut the file short, so both are ignored from here on."""
    if path is None:
        return None
    path = rank_path(path, dist.get_rank())

    def write(result: dict) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        partial = {"environment": environment(device),
                   "peak_flops": peak_flops_per_second(device, cfg.peak_tflops, cfg.dtype),
                   "engines": [*done, result]}
        with open(f"{path}.tmp", "w") as f:
            json.dump(partial, f)
        os.replace(f"{path}.tmp", path)

    return write


def main(argv: Optional[list[str]] = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    cfg = TrainConfig.from_json(spec["config"])
    rank = int(os.environ["RANK"])
    if cfg.device == "cpu":
        torch.set_num_threads(int(spec["threads"]))
    try:
        with faults.supervised(cli=True):
            partial = run_engines(cfg, tuple(spec["runs"]), cfg.progress,
                                  stopped_path=spec["partial"])
        if rank == 0:
            with open(spec["partial"], "w") as f:
                json.dump(partial, f)
        return 0
    except KeyboardInterrupt:
        return faults.INTERRUPTED_EXIT_CODE
    except SystemExit as e:  # supervised(): Ctrl-C (130), SIGTERM from the launcher (143)
        return e.code if isinstance(e.code, int) else 1
    except (CheckpointError, PlanExceedsMemoryError) as e:
        # Every rank raises the same error (checkpoint.py agrees on verdicts; a plan's inputs
        # are rank-agreed): one line, no traceback; it is the user's input, so status 2
        # (refusals.py).
        text = checkpoint_refusal(e, resume_from_command(spec["argv"])) \
            if isinstance(e, CheckpointError) else plan_refusal(cfg.for_run(spec["runs"][0]), e)
        with open(f"{spec['partial']}.rank{rank}.err", "w") as f:
            f.write(text)
        if rank == 0:
            from .progress import print_error

            print_error(spec["command"], text)
        return 2
    except BaseException:  # noqa: BLE001 - the launcher prints it, once ([Note: one line per cause])
        with open(f"{spec['partial']}.rank{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    with faults.unsaid_stop_noise():  # to the end of the rank: [Note: what a stop leaves unsaid]
        code = main()
    faults.end_process(code)  # [Note: worker teardown order]
