"""benches/plain_setup.py, the script every issue-36 GPU row runs through, in the placements only
the GPU calls would otherwise try first: the user's checkpoint by ``apply_activation_checkpointing``,
selective, none; with attention dropout whose RNG the checkpoint does not replay. Each one trains
``zbuf.compile(model, optimizer=opt)`` beside FSDP2 on the same model and batches (one gloo rank),
and the two agree step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("placement,extra", [
    ("wrapper", []),
    ("selective", []),
    ("none", ["--attn-dropout", "0.1", "--no-preserve-rng-state"]),
])
def test_zbuf_compile_trains_as_fsdp2_in_the_plain_setup(placement, extra, tmp_path):
    from zbuf.memory import users_allocator_settings

    out = tmp_path / placement
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benches", "plain_setup.py"),
                    "--preset", "tiny", "--steps", "3", "--warmup", "1", "--ac", "full",
                    "--placement", placement, "--variants", "zbuf.compile,fsdp2",
                    "--out", str(out), *extra],
                   check=True, capture_output=True, text=True, timeout=600, env=env)
    result = json.loads((out / "plain_setup.json").read_text())
    assert result["args"]["placement"] == placement
    assert result["allocator_settings"] == users_allocator_settings(env)  # whose, for the rows
    runs = {v["variant"]: v for v in result["variants"]}
    assert runs["zbuf.compile"]["status"] == runs["fsdp2"]["status"] == "ok"
    assert all(len(r["step_s"]) == 3 for r in runs.values())
    assert runs["zbuf.compile"]["losses"] == pytest.approx(runs["fsdp2"]["losses"], rel=1e-5)
    for run in runs.values():  # where the first step's time went, phase by phase
        # On the CPU (no host link) zbuf's default re-plans nothing: its final plan is step 0's.
        assert run["replanned_steps"] == [] and run["compiled_steps"][0] == 0
        assert run["time_to_final_plan_s"] == sum(
            run["step_s"][:max(run["compiled_steps"]) + 1])
        first = run["compile_phases_by_step"]["0"]
        assert first["first_step_s"] == run["step_s"][0]
        assert sum(first["phases"].values()) == pytest.approx(first["first_step_s"], rel=1e-6)
        assert first["caches"]["graphs"] > 0
    # zbuf's own rows of the card, a step each, and its trading counts; none for FSDP2.
    rows = runs["zbuf.compile"]["memory_rows"]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 2
    assert all(r["forward_peak_bytes"] > 0 and r["pool_held_bytes"] >= 0 for r in rows)
    assert set(runs["zbuf.compile"]["memory_events"]) >= {"yields", "reclaims", "cache_releases"}
    assert "memory_rows" not in runs["fsdp2"]
    # The communication estimate beside the step: zbuf's collectives counted over the measured
    # steps reduce each gradient once, the bytes FSDP2's are derived to reduce.
    counted, derived = runs["zbuf.compile"]["communication"], runs["fsdp2"]["communication"]
    assert counted["source"].startswith("counted") and derived["source"].startswith("derived")
    assert counted["reduce_scatter_bytes"] == derived["reduce_scatter_bytes"] > 0
    assert f"the user's checkpoint: {placement}" in (out / "plain_setup.md").read_text()
