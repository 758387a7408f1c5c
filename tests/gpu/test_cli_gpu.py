"""``zbuf bench`` / ``zbuf train`` on the GPU machine: every visible GPU over NCCL, bf16 compute,
fair memory counting, ``--mem-frac``. Skipped without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ZBUF = [sys.executable, "-m", "zbuf.cli"]


def _run(args, timeout=580):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(ZBUF + args, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_every_engine_on_all_gpus(tmp_path):
    out = tmp_path / "bench.json"
    res = _run(["bench", "--engines", "zbuf,zbuf-eager,fsdp2,ddp", "--preset", "tiny",
                "--seq-len", "512", "--micro-batch", "4", "--steps", "8", "--warmup", "3",
                "--out", str(out)])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    record = json.loads(out.read_text())
    gpus = torch.cuda.device_count()
    assert record["world_size"] == gpus
    assert record["config"]["dtype"] == "bf16" and record["config"]["ac"] == "full"  # GPU default
    env = record["environment"]
    assert env["device_type"] == "cuda" and env["nccl"] and env["gpu"]
    # Every engine in its best configuration unless the run's environment configured torch's
    # allocator ([Note: torch's allocator grows in place] in zbuf/memory/shared.py).
    from zbuf.memory import users_allocator_settings

    users = users_allocator_settings(os.environ)
    assert env["torch_allocator"] == (users or "expandable_segments:True (zbuf's)"), env
    losses = {}
    for eng in record["engines"]:
        assert eng["status"] == "ok", eng.get("error")
        s = eng["summary"]
        assert len(s["alloc_retries_per_rank"]) == gpus
        for r in eng["per_rank"]:
            assert r["allocated_peak_bytes"] > 0 and r["peak_device_bytes"] >= r["allocated_peak_bytes"]
        if any(k in env["gpu"] for k in ("H100", "H200")):
            assert 0 < s["mfu"] < 1
        losses[eng["engine"]] = s["losses"]
        if eng["engine"].startswith("zbuf"):
            # fair memory: the pool's bytes are part of the device figure
            assert s["pool"]["high_water_bytes"] > 0
            assert max(r["peak_device_bytes"] for r in eng["per_rank"]) >= s["pool"]["high_water_bytes"]
    # Same init and data; bf16 compute: the first loss agrees closely, the curves loosely.
    first = [v[0] for v in losses.values()]
    assert max(first) - min(first) < 0.02, losses
    assert (tmp_path / "bench.md").read_text().count("|") > 20


def test_mem_frac_caps_allocator_and_pool_together(tmp_path):
    out = tmp_path / "run.json"
    res = _run(["train", "--engine", "zbuf", "--preset", "tiny", "--seq-len", "256",
                "--steps", "4", "--warmup", "1", "--mem-frac", "0.5", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    cap = json.loads(out.read_text())["engines"][0]["memory_cap"]
    assert cap["mem_frac"] == 0.5
    total = cap["device_total_bytes"]
    # [Note: fair memory cap] in train/loop.py: torch's share and the pool's share add up to the cap.
    assert cap["allocator_fraction"] * total + cap["pool_share_bytes"] <= 0.5 * total + 1
