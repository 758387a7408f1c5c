"""Simulated ranks on the GPU ([Note: simulated ranks] in zbuf/train/simulate.py): every engine as
rank 0 of 4 on one GPU, on an emulated card of ``--gpu-memory``; ``zbuf fit`` with a CUDA card.
Skipped without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(args, timeout=580):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "zbuf.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_bench_simulated_world_on_an_emulated_card(tmp_path):
    out = tmp_path / "bench.json"
    res = _run(["bench", "--engines", "zbuf,zbuf-eager,fsdp2,ddp", "--preset", "tiny",
                "--seq-len", "512", "--micro-batch", "4", "--steps", "6", "--warmup", "2",
                "--simulate-world", "4", "--gpu-memory", "8GiB", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["simulated"]["world_size"] == 4 and record["world_size"] == 4
    total = torch.cuda.get_device_properties(0).total_memory
    assert record["config"]["mem_frac"] == pytest.approx((8 << 30) / total)
    for eng in record["engines"]:
        assert eng["status"] == "ok", eng.get("error")
        assert len(eng["per_rank"]) == 1 and eng["communication"]["seconds"] > 0
        assert eng["per_rank"][0]["peak_device_bytes"] <= 8 << 30
        cap = eng["memory_cap"]
        if eng["engine"].startswith("zbuf"):  # [Note: emulated capacity]: allocator + pool
            assert cap["capacity_bytes"] == int(record["config"]["mem_frac"] * total)
    assert "SIMULATED" in res.stdout


def test_fit_on_a_cuda_card(tmp_path):
    out = tmp_path / "fit.json"
    res = _run(["fit", "--preset", "tiny", "--engine", "zbuf-eager", "--simulate-world", "4",
                "--gpu-memory", "2GiB", "--seq-len", "2048", "--steps", "3",
                "--max-micro-batch", "8", "--probe-timeout", "120", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    found = json.loads(out.read_text())
    assert found["micro_batch"] >= 1
    assert all(p["peak_bytes"] <= 2 << 30 for p in found["probes"] if p["fits"])
