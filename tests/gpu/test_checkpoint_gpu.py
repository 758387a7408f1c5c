"""Checkpoints and bad input on CUDA/NCCL (issue 7), for the GPU machine (1 or 2 GPUs).

The workers run under torchrun (this file as a script): a sharded ``tiny`` decoder on CUDA trains
3 steps, saves through DCP from device memory, trains on, then a fresh model and optimizer load
the checkpoint: every shard and AdamW state must equal the saved bytes. The same launch checks
that a module spread over CPU and CUDA is refused by ``zbuf.shard``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda


def _worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    import zbuf.checkpoint as ckpt
    import zbuf.faults as faults
    from zbuf.shard import ShardingError, shard
    from zbuf.models import build_model, loss
    from zbuf.train.data import Task, rank_batch

    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    faults.configure_timeout(120)
    rank, world = dist.get_rank(), dist.get_world_size()
    with faults.supervised():
        def make():
            torch.manual_seed(0)
            model = shard(build_model("tiny", device=device))
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train(model, opt, start, stop):
            for step in range(start, stop):
                b = rank_batch(Task.STRIDE, 0, step, 2, world, rank, 32, 256, device)
                loss(model, b.tokens, b.targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        def snapshot(model, opt):
            out = {f"p.{n}": p.detach().cpu().clone() for n, p in model.named_parameters()}
            names = {id(p): n for n, p in model.named_parameters()}
            for p, st in opt.state.items():
                out.update({f"s.{names[id(p)]}.{k}": v.detach().cpu().clone() for k, v in st.items()})
            return out

        model, opt = make()
        train(model, opt, 0, 3)
        path = ckpt.save_checkpoint(ckpt.checkpoint_path(out_dir, 3), model, opt, step=3)
        saved = snapshot(model, opt)
        train(model, opt, 3, 5)

        fresh, fresh_opt = make()
        info = ckpt.load_checkpoint(out_dir, fresh, fresh_opt)
        loaded = snapshot(fresh, fresh_opt)
        assert info.step == 3 and info.path == path
        assert saved.keys() == loaded.keys(), saved.keys() ^ loaded.keys()
        bad = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        assert not bad, f"differ after load: {bad}"
        assert all(p.device == device for p in fresh.parameters())
        train(fresh, fresh_opt, 3, 4)  # and it trains on

        mixed = nn.Sequential(nn.Linear(4, 4).to(device), nn.Linear(4, 4))
        try:
            shard(mixed)
        except ShardingError as e:
            assert "several devices" in str(e), e
        else:
            raise AssertionError("a module on CPU and CUDA was sharded")
        dist.barrier()
        if rank == 0:
            with open(os.path.join(out_dir, "OK"), "w") as f:
                f.write("ok")


@pytest.mark.parametrize("nproc", [min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1])
def test_checkpoint_roundtrip_on_cuda(tmp_path, nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", __file__, "roundtrip", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and (tmp_path / "OK").exists(), proc.stdout[-4000:] + proc.stderr[-8000:]


def _killed_peer_worker(timeout_s: float) -> None:
    """Rank 1 dies by SIGKILL between forward and backward; rank 0 must not hang."""
    import signal
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import zbuf.faults as faults
    from zbuf.shard import shard
    from zbuf.models import build_model, loss
    from zbuf.train.data import Task, rank_batch

    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    faults.configure_timeout(timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    with faults.supervised():
        torch.manual_seed(0)
        model = shard(build_model("tiny", device=device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(6):
            b = rank_batch(Task.STRIDE, 0, step, 2, world, rank, 32, 256, device)
            out = loss(model, b.tokens, b.targets)
            if step == 3 and rank == 1:
                print(f"FAULT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_killed_rank_stops_nccl_peer(tmp_path):
    import socket
    import time

    timeout_s = 30.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, __file__, "killed", str(timeout_s)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out1, _ = procs[1].communicate(timeout=300)
        fault = float(next(l for l in out1.splitlines() if l.startswith("FAULT")).split()[1])
        out0, err0 = procs[0].communicate(timeout=timeout_s + 120)
        waited = time.time() - fault
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0, err0[-4000:]
    # NCCL reports a dead peer through the watchdog: within the timeout plus its polling
    assert waited < timeout_s + 90, (waited, err0[-4000:])


if __name__ == "__main__":
    if sys.argv[1] == "roundtrip":
        _worker(sys.argv[2])
    else:
        _killed_peer_worker(float(sys.argv[2]))
