"""Multi-rank gloo jobs that must exit cleanly: the README's pattern, run by ``test_exit.py``.

    python tests/exit_job.py --world 2 --runs 10 [--compile-runs 1] [--fresh-runs 1]

Each run is one job of ``--world`` ranks doing what the README's multi-rank example does:
``import zbuf`` first, ``init_process_group``, ``zbuf.shard``, a few training steps (eager, or
``zbuf.compile(model, optimizer=opt)`` on aot_eager), ``zbuf.save_checkpoint``, ``zbuf.load_checkpoint``,
``zbuf.full_state_dict``, then ``destroy_process_group()`` while the model and optimizer are still
alive, as a user's script has them. Each rank then checks that no gloo worker thread
(``pt_gloo_runloop``) survived destroy and exits through normal interpreter finalisation, where a
surviving thread kills the process with SIGABRT ([Note: a model does not keep its group alive]
in ``zbuf/shard_state.py``). The launcher exits 0 only if every rank of every run exited 0.

Most runs fork their ranks from this process after ``import zbuf`` (importing torch costs about
3 s of CPU per process, the job itself well under one); ``--fresh-runs`` start each rank as a new
interpreter instead. Either way a rank is its own process that finalises its own interpreter.
"""

import zbuf  # noqa: I001 - before init_process_group: the README's rule

import argparse
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

RUN_TIMEOUT_S = 300.0
LEFT_THREADS_EXIT = 3


def gloo_threads() -> list[str]:
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return [n for n in names if n == "pt_gloo_runloop"]


def rank_main(rank: int, world: int, port: int, ckpt_dir: str, compiled: bool) -> int:
    """One rank of the pattern; the exit status it wants."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    del store
    torch.manual_seed(0)
    cfg = zbuf.models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                                  num_kv_heads=1, head_dim=16, ffn_hidden_size=64,
                                  tie_embeddings=True, max_seq_len=64)
    model = zbuf.shard(zbuf.models.build_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = zbuf.compile(model, optimizer=opt, inner="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        zbuf.models.loss(run, tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    zbuf.save_checkpoint(Path(ckpt_dir) / "step_00000002", model, opt, step=2)
    info = zbuf.load_checkpoint(ckpt_dir, model, opt)
    assert info.step == 2, info
    full = zbuf.full_state_dict(model)
    assert full["embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size), list(full)
    dist.destroy_process_group()
    left = gloo_threads()
    if left:
        print(f"rank {rank}: {len(left)} pt_gloo_runloop thread(s) alive after "
              f"destroy_process_group()", file=sys.stderr, flush=True)
        return LEFT_THREADS_EXIT
    return 0


def _fork_rank(rank: int, world: int, ckpt_dir: str, compiled: bool) -> tuple[int, int]:
    """Fork one rank; (pid, write end of the pipe that will carry the store's port)."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(read_fd)
        return pid, write_fd
    # The child: no try/finally or with-block of the launcher encloses this, so the SystemExit
    # below unwinds straight to the interpreter's normal finalisation.
    os.close(write_fd)
    port = int(os.read(read_fd, 32).decode())
    os.close(read_fd)
    os.environ["RANK"] = str(rank)  # zbuf.faults names ranks by it
    raise SystemExit(rank_main(rank, world, port, ckpt_dir, compiled))


def one_run(world: int, compiled: bool, fresh: bool) -> list[str]:
    """Run one job; the problems seen (empty: every rank exited 0)."""
    ckpt_dir = tempfile.mkdtemp(prefix="zbuf-exit-")
    if fresh:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        pids = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),
                                  "--port", str(store.port), "--dir", ckpt_dir]
                                 + (["--compiled"] if compiled else []))
                for r in range(world)]
    else:
        forked = [_fork_rank(r, world, ckpt_dir, compiled) for r in range(world)]
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        for _, fd in forked:
            os.write(fd, str(store.port).encode())
            os.close(fd)
        pids = [pid for pid, _ in forked]
    codes = _wait_all(pids)
    del store
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    problems = []
    for rank, code in enumerate(codes):
        if code is None:
            problems.append(f"rank {rank} still running after {RUN_TIMEOUT_S:.0f} s (killed)")
        elif code < 0:
            problems.append(f"rank {rank} killed by {signal.Signals(-code).name}")
        elif code == LEFT_THREADS_EXIT:
            problems.append(f"rank {rank} had gloo threads alive after destroy_process_group()")
        elif code:
            problems.append(f"rank {rank} exited {code}")
    return problems


def _wait_all(pids) -> list:
    """Exit codes (negative: killed by that signal; None: timed out and killed), by rank."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    codes: dict[int, int | None] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for rank, p in enumerate(pids):
            if rank in codes:
                continue
            if isinstance(p, subprocess.Popen):
                code = p.poll()
            else:
                done, status = os.waitpid(p, os.WNOHANG)
                code = os.waitstatus_to_exitcode(status) if done else None
            if code is not None:
                codes[rank] = code
        time.sleep(0.05)
    for rank, p in enumerate(pids):
        if rank not in codes:
            codes[rank] = None
            if isinstance(p, subprocess.Popen):
                p.kill()
                p.wait()
            else:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
    return [codes[r] for r in range(len(pids))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--runs", type=int, default=0, help="forked runs, eager")
    ap.add_argument("--compile-runs", type=int, default=0, help="forked runs, zbuf.compile (aot_eager)")
    ap.add_argument("--fresh-runs", type=int, default=0, help="eager runs whose ranks are new interpreters")
    # one rank of a fresh run (started by the launcher)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--dir")
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    if args.rank is not None:
        os.environ["RANK"] = str(args.rank)
        return rank_main(args.rank, args.world, args.port, args.dir, args.compiled)

    # Forked ranks inherit the launcher's objects; frozen, their final collection skips them
    # (about 0.9 s of CPU per rank), and no page is copied for a collector's bookkeeping.
    gc.freeze()
    plan = ([(False, False)] * args.runs + [(True, False)] * args.compile_runs
            + [(False, True)] * args.fresh_runs)
    failed = 0
    t0 = time.monotonic()
    for i, (compiled, fresh) in enumerate(plan):
        problems = one_run(args.world, compiled, fresh)
        kind = ("fresh " if fresh else "") + ("compile" if compiled else "eager")
        if problems:
            failed += 1
            print(f"run {i} ({kind}, {args.world} ranks): " + "; ".join(problems), flush=True)
    print(f"{args.world}-rank runs: {len(plan) - failed} of {len(plan)} exited cleanly "
          f"({time.monotonic() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
