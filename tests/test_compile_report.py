"""``schedule_report`` on the qwen3-8b preset traced with fake tensors (issue 4, "Must show").

The model is built and sharded on the meta device under a fake 8-rank process group, compiled with
the zbuf backend and run forward and backward on meta tensors: every shape is real, no memory is
used and no collective runs. The records' graph summaries are then re-planned for budgets from one
layer's gathered bytes to the whole model's: the peak live gathered bytes never exceed the budget,
and the planning time is reported. CI traces 4 of the preset's 36 layers (every byte size is the
preset's; tracing all 36 takes minutes on two cores): ``ZBUF_SLOW=1`` traces them all.

Runs in a subprocess: the fake process group must be the default group of its process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _trace_and_replan(preset: str, num_layers: int | None, world: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    import zbuf.shard as zshard
    from zbuf.compile import CompileOptions, schedule_report
    from zbuf.compile.report import graph_summary
    from zbuf.compile.schedule import plan_schedule
    from zbuf.models import apply_activation_checkpointing, build_model, loss, resolve_config

    # zbuf.shard refuses meta shards (a fake group's backend lists no meta device, and meta tensors
    # need no pool); nothing here runs a collective or touches a pool.
    zshard._check_group_device = lambda group, device: None

    class NoPool:
        def __getattr__(self, name):
            raise AssertionError(f"pool.{name} used while tracing on meta tensors")

    cfg = resolve_config(preset)
    if num_layers is not None:
        cfg = cfg.replace(num_layers=num_layers)
    model = apply_activation_checkpointing(build_model(cfg, device="meta", dtype=torch.bfloat16))
    model = zshard.shard(model, device="meta", pool=NoPool())
    root = model._zbuf_root
    layer_bytes = sum(s.gathered_nbytes for s in root.specs.values() if s.fqn.startswith("layers.0."))
    model_bytes = root.gathered_nbytes
    largest = max(s.gathered_nbytes for s in root.specs.values())
    t0 = time.perf_counter()
    cm = torch.compile(model, backend="zbuf", fullgraph=True,
                       options={"inner": "aot_eager", "budget_bytes": 2 * layer_bytes, "persist": False})
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    loss(cm, tokens, tokens).backward()
    trace_seconds = time.perf_counter() - t0
    records = schedule_report(model)
    out = {"layer_bytes": layer_bytes, "model_bytes": model_bytes, "largest_gather_bytes": largest, "trace_seconds": trace_seconds,
           "records": [json.loads(r.to_json()) for r in records], "replans": []}
    # From one layer (or the largest single gather, the vocab-sized matrices, when bigger) to all.
    low = max(layer_bytes, largest)
    budgets = sorted({low, low + layer_bytes, low + 4 * layer_bytes, model_bytes // 2, model_bytes})
    for r in records:
        summary = graph_summary(r)
        for b in budgets:
            s = plan_schedule(summary, b, CompileOptions(persist=False))
            out["replans"].append({
                "kind": r.kind, "budget": b, "effective_budget": s.budget_bytes, "floor": s.floor_bytes,
                "peak": s.peak_live_bytes, "prefetched": s.prefetched, "regathers": s.regathers,
                "fetches": len(s.fetches), "planning_seconds": s.planning_seconds,
                "num_nodes": summary.num_nodes,
            })
    return out


def _run(preset: str, num_layers: int | None, world: int = 8, seq: int = 4096) -> dict:
    code = (
        "import json, sys, test_compile_report as t; "
        f"print('RESULT' + json.dumps(t._trace_and_replan({preset!r}, {num_layers!r}, {world}, {seq})))"
    )
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"trace failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT"):])


@pytest.mark.parametrize("num_layers", [None if os.environ.get("ZBUF_SLOW") == "1" else 4])
def test_qwen3_8b_fake_trace_report(num_layers):
    out = _run("qwen3-8b", num_layers)
    kinds = [r["kind"] for r in out["records"]]
    assert kinds == ["forward", "backward"], kinds
    for r in out["records"]:
        assert r["peak_live_gathered_bytes"] <= r["budget_bytes"]
        assert r["gathers"] > 0 and r["collectives"] > 0 and r["fingerprint"]
        assert r["planning_seconds"] < 5.0
        live, act = r["live_gathered_profile"], r["activation_profile"]
        assert len(live) == len(act) == min(r["num_nodes"], 2000)
        assert max(live) == r["peak_live_gathered_bytes"] and max(act) == r["activation_peak_bytes"]
    assert out["replans"]
    for p in out["replans"]:
        # The floor is what one node needs at once: never more than the largest gather here.
        assert p["floor"] <= max(out["layer_bytes"], out["largest_gather_bytes"]), p
        assert p["effective_budget"] == p["budget"], p
        assert p["peak"] <= p["budget"], p
        assert p["planning_seconds"] < 5.0, p
    whole = [p for p in out["replans"] if p["budget"] == out["model_bytes"]]
    assert all(p["regathers"] == 0 for p in whole)
    print(json.dumps({k: v for k, v in out.items() if k != "records"}, indent=1))
