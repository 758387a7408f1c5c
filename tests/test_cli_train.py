"""``zbuf train`` / ``bench`` / ``report`` end to end on CPU (2 gloo ranks, tiny preset), as a
user runs them: real processes through the console entry point.

Kept to a few launches (each one starts 3 Python processes); sizes are the smallest that still
show the loss falling.
"""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from started import Started

# The installed console script, as a user runs it (python -m zbuf.cli from a bare checkout).
ZBUF = [shutil.which("zbuf")] if shutil.which("zbuf") else [sys.executable, "-m", "zbuf.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def _run(args, timeout=400, env=None):
    out = subprocess.run(ZBUF + args, capture_output=True, text=True, timeout=timeout,
                         env=dict(ENV, **(env or {})))
    return out


def _why(res, out=None):
    """What a failed run said, including the failing rank's traceback from the record."""
    text = res.stdout[-3000:] + res.stderr[-3000:]
    if out is not None and os.path.exists(out):
        with open(out) as f:
            text += "".join(f"\n{e['engine']}: {e.get('error', '')}" for e in json.load(f)["engines"])
    return text


def _check_record(record, engines, steps):
    assert record["schema"] == "zbuf.run/1"
    assert record["world_size"] == 2
    assert record["config"]["preset"] == "tiny" and record["config"]["steps"] == steps
    assert record["environment"]["torch"] and record["environment"]["device_type"] == "cpu"
    assert record["environment"]["torch_allocator"] is None  # the host has no segments to grow
    assert record["model"]["params"] > 1e6
    assert [e["engine"] for e in record["engines"]] == engines
    for eng in record["engines"]:
        assert eng["status"] == "ok", eng.get("error")
        assert [s["step"] for s in eng["steps"]] == list(range(steps))
        for s in eng["steps"]:
            assert s["time_s"] > 0 and s["device_bytes"] > 0 and len(s["alloc_retries"]) == 2
            assert s["tokens"] == 2 * record["config"]["micro_batch"] * record["config"]["seq_len"]
        assert [r["rank"] for r in eng["per_rank"]] == [0, 1]
        summary = eng["summary"]
        for key in ("step_time_median_s", "step_time_min_s", "step_time_max_s",
                    "tokens_per_s_per_gpu", "peak_device_bytes", "first_step_s", "final_loss"):
            assert summary[key] > 0, key
        assert summary["measured_steps"] == steps - record["config"]["warmup"]
        assert summary["step_time_min_s"] <= summary["step_time_median_s"] <= \
            summary["step_time_max_s"]
        _check_phases(eng)


def _check_phases(eng):
    """The first step cut into phases on every rank ([Note: compile phases]): they add up to
    the step, and the ones every compiling engine goes through took time."""
    from zbuf.train.compile_phases import PHASES

    assert len(eng["compile_phases"]) == 2
    for ph in eng["compile_phases"]:
        assert set(ph["phases"]) == set(PHASES)
        assert abs(sum(ph["phases"].values()) - ph["first_step_s"]) <= 1e-6 * ph["first_step_s"]
        assert ph["phases"]["first_run"] > 0
        if eng["engine"] != "zbuf-eager":  # the engines that compile
            assert ph["phases"]["dynamo"] > 0 and ph["phases"]["aot"] > 0
            assert ph["caches"]["graphs"] >= 1
        if eng["engine"] == "zbuf" and not eng["schedule"].get("blocks"):  # the graph's passes
            assert ph["phases"]["zbuf"] > 0 and ph["zbuf_passes"]["plan"] > 0
    slowest = eng["summary"]["compile_phases"]
    assert slowest["first_step_s"] == max(p["first_step_s"] for p in eng["compile_phases"])
    assert slowest["first_step_s"] == pytest.approx(eng["steps"][0]["time_s"])


_TRAIN_STEPS = 16  # the fewest in which the tiny preset's loss falls by well over 1.0 (1.45)


def _reference_losses(steps):
    """Single-process, unsharded fp32 training on the same initial model and global batches: what
    every engine must reproduce (to float rounding) on CPU. Computed once for the longest run and
    sliced (a reference step costs about a second of CPU)."""
    assert steps <= _TRAIN_STEPS
    return _reference_trajectory()[:steps]


@functools.lru_cache(maxsize=1)
def _reference_trajectory(micro_batch=8, seq_len=64, world=2):
    from zbuf.train.config import TrainConfig
    from train_reference import reference_losses

    cfg = TrainConfig().resolve(cuda=False, world=world, bench=False)
    return reference_losses(cfg, _TRAIN_STEPS, micro_batch, seq_len, world)


def _assert_matches_reference(losses, ref):
    # Float rounding differs (reduction order); AdamW amplifies it step by step, so the bar is
    # tight over the first ten steps and looser over the whole trajectory.
    assert losses[:10] == pytest.approx(ref[:10], rel=1e-5)
    assert losses == pytest.approx(ref, rel=1e-3)


def _png_has_plot(path):
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300, img.shape
    rgb = img[..., :3]
    # A blank figure is one colour; a plot has axes, text and coloured data lines.
    assert rgb.std() > 0.05
    coloured = (rgb.max(axis=2) - rgb.min(axis=2)) > 0.25
    assert coloured.mean() > 0.002, "no coloured (data) pixels"


def test_killed_rank_is_named_in_the_error_and_the_record(tmp_path):
    # Rank 1 dies after its first step; rank 0 notices in the next collective and exits first
    # ("a peer died"). The error must name rank 1 and how it died ([Note: which rank failed]).
    out = tmp_path / "run.json"
    res = _run(["train", "--steps", "4", "--out", str(out)],
               env={"ZBUF_FAULT": "train.step_done@1"})
    assert res.returncode == 1, _why(res, out)
    said = "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer, or a kill -9)"
    assert f"engine zbuf failed (exit 1): {said} and left no traceback" in res.stderr, res.stderr
    # One line per distinct cause; the survivor's own paragraph once; no plots of a failed run.
    assert "also rank 0 stopped because another rank failed (exit 75)" in res.stderr, res.stderr
    assert res.stderr.count("stopped: a collective failed") <= 1, res.stderr
    assert "configure_timeout" not in res.stderr, res.stderr  # the CLI's options, not Python
    assert f"record: {out}" in res.stdout and "zbuf report" not in res.stdout, res.stdout
    eng = json.loads(out.read_text())["engines"][0]
    assert eng["status"] == "failed" and said in eng["error"]


def _started(args, where, name, env=None) -> Started:
    """A ``zbuf`` command of this file's, started in the background (tests/started.py)."""
    return Started(ZBUF + args, where, name, dict(ENV, **(env or {})))


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """The one-rank runs of the tests below, started together: each is one worker process (and a
    launcher waiting on it), so CI's two cores take them in less than the time of one after the
    other (13-14 s each).

    Returns ``{name: (completed process, record path)}``."""
    where = tmp_path_factory.mktemp("one_rank")
    started = {
        "oom": _started(["train", "--nproc", "1", "--steps", "3", "--out", str(where / "oom.json")],
                        where, "oom", env={"ZBUF_FAULT": "train.backward",
                                           "ZBUF_FAULT_SIGNAL": "OOM"}),
        "floor": _started(["train", "--steps", "2", "--gather-budget", "1", "--nproc", "1",
                           "--out", str(where / "floor.json")], where, "floor"),
        "blocks": _started(["train", "--steps", "4", "--nproc", "1", "--layers", "2",
                            "--compile-structure", "blocks", "--ac", "auto",
                            "--out", str(where / "blocks.json")], where, "blocks"),
        "no-fit": _started(["train", "--steps", "2", "--gpu-memory", "20MiB", "--nproc", "1",
                            "--out", str(where / "no-fit.json")], where, "no-fit"),
    }
    try:
        return {name: (s.result(timeout=400), where / f"{name}.json") for name, s in started.items()}
    finally:
        for s in started.values():
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


def test_a_step_that_runs_out_of_memory_keeps_where_it_failed_in_the_record(one_rank_runs):
    # [Note: interrupted runs] in zbuf/train/loop.py: the record of a failed step says which step
    # and phase failed, with the plans in force and the steps done, not just the error.
    res, out = one_rank_runs["oom"]
    assert res.returncode == 1, _why(res, out)
    assert "OutOfMemoryError: injected at fault point train.backward" in res.stderr, res.stderr
    eng = json.loads(out.read_text())["engines"][0]
    assert eng["status"] == "failed" and "OutOfMemoryError" in eng["error"]
    assert eng["failed_at"]["step"] == 0 and eng["failed_at"]["phase"] == "backward", eng["failed_at"]
    assert eng["failed_at"]["error"].startswith("OutOfMemoryError: injected"), eng["failed_at"]
    assert eng["steps"] == []
    # The plan that ran is in the record: the default's block frames ([Note: one path]).
    assert eng["schedule"]["blocks"]["frames_compiled"] >= 1, eng["schedule"]
    assert eng["step_memory"]["measured"] is None  # failed before the measured step closed


def test_a_plan_that_does_not_fit_is_one_line_naming_the_options(one_rank_runs):
    # [Note: a plan that does not fit, on the command line] in zbuf/train/refusals.py: not 83
    # lines of Dynamo traceback and exit 1, but the numbers and the options to change, exit 2,
    # and no record of a run that never trained a step (issue 37, items 1 and 11). On a 20 MiB
    # card not even one block's gathered weights fit beside the model's state (at 30 MiB the
    # plan trains, its optimizer's state offloaded: tests/test_step_offload.py).
    res, out = one_rank_runs["no-fit"]
    assert res.returncode == 2, _why(res, out)
    assert "Traceback" not in res.stderr and "TORCHDYNAMO" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith("zbuf train: error: one block's gathered weights needs "), errors
    for part in ("MiB but every rank has", "MiB for it (of --gpu-memory 20.00 MiB, less the "
                 "model's state and a margin)", "use --compile-structure graph",
                 "a larger --gpu-memory"):
        assert part in errors[0], errors[0]
    assert not out.exists()


def _assert_clean_teardown(res, torch_keeps=False):
    """Every rank destroyed its group and no gloo thread was left, or (``torch_keeps``: FSDP2,
    whose mesh DTensor's caches keep) the rank ended without interpreter finalisation
    ([Note: worker teardown order]). The launcher shows a line once for all ranks that print
    it up to its numbers ([Note: one line per cause])."""
    lines = [line for line in res.stderr.splitlines() if "zbuf: released resources" in line]
    assert lines and all("process group destroyed" in line for line in lines), lines
    assert any("no gloo worker thread left" in line for line in lines), lines
    kept = "gloo worker thread(s) still running" in res.stderr
    ended = "exiting without interpreter finalisation" in res.stderr
    assert kept == ended == torch_keeps, res.stderr[-3000:]


def test_train_default_engine_then_report(tmp_path):
    out = tmp_path / "run.json"
    steps = _TRAIN_STEPS
    res = _run(["train", "--steps", str(steps), "--out", str(out)], env={"ZBUF_LOG_EXIT": "1"})
    assert res.returncode == 0, _why(res, out)
    _assert_clean_teardown(res)
    record = json.loads(out.read_text())
    _check_record(record, ["zbuf"], steps)
    eng = record["engines"][0]
    losses = eng["summary"]["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # visibly learning
    _assert_matches_reference(losses, _reference_losses(steps))
    assert eng["pool"]["hits"] > 0 and eng["summary"]["pool"]["high_water_bytes"] > 0
    assert eng["schedule"]["blocks"]["frames_compiled"] >= 1, "zbuf compiled no block frame"
    assert eng["summary"]["schedule_budget_bytes"] >= eng["summary"]["schedule_peak_live_bytes"]
    assert "loss (mean over ranks)" in res.stdout and "zbuf" in res.stdout  # summary table
    # The loss shown live is the record's (and the summary's): the mean over ranks, labelled.
    live = [float(line.split("mean loss ")[1].split()[0]) for line in res.stdout.splitlines()
            if "mean loss " in line]
    assert len(live) == steps and "loss: the mean over ranks" in res.stdout, res.stdout
    assert live == [round(x, 4) for x in losses], (live, losses)
    # The report command on a line of its own, whole, however long the path (rich wraps at 80
    # columns in a pipe; it split "zbuf report PATH" before)
    assert f"plots:  zbuf report {out}" in res.stdout.splitlines(), res.stdout
    # The README's sample is this run's output (issue 37: it showed a budget of 18.87 GiB where
    # runs planned 6.76 MiB), its first loss too.
    from test_readme import check_sample, readme_sample

    check_sample("train", res.stdout)
    first = re.search(r"step 1/\d+  mean loss (\S+)", readme_sample("train")).group(1)
    assert float(first) == live[0], (first, live[0])

    plots = tmp_path / "plots"
    # The measured step's plan and the grown one are two graphs each: a wide terminal keeps the
    # schedule table's labels on one line.
    rep = _run(["report", str(out), "-o", str(plots)], timeout=120, env={"COLUMNS": "200"})
    assert rep.returncode == 0, rep.stderr
    names = sorted(os.listdir(plots))
    # No recompute.png: nothing of the default CPU run (--ac off) is checkpointed.
    assert names == ["compile_phases.png", "loss.png", "memory.png", "schedule_memory.png",
                     "step_memory.png", "step_time.png"]
    from test_readme import readme_report_plots  # the README's sample output lists them all

    assert sorted(readme_report_plots()) == names, readme_report_plots()
    assert [line.split("/")[-1] for line in rep.stdout.splitlines()
            if line.startswith("wrote ")] == readme_report_plots()  # in the order written
    check_sample("report", rep.stdout)
    for name in names:
        _png_has_plot(plots / name)
    assert "peak live gathered" in rep.stdout  # the schedule table
    assert "first step by phase" in rep.stdout and "Dynamo tracing" in rep.stdout
    # Issue 21: the time to the plan the run kept, the record's (this run's re-plan compiles
    # nothing, so no re-plan table: tests/test_train_record.py has one).
    final = [line for line in rep.stdout.splitlines() if "time to the final plan" in line]
    assert len(final) == 1 and f"{eng['summary']['time_to_final_plan_s']:.2f} s" in final[0], final
    assert "re-plan compiles by phase" not in rep.stdout
    assert "gather budget, measured" in rep.stdout  # the step-memory table
    _check_plot_layout(json.loads(out.read_text()), tmp_path / "again")


def _check_recompute_layout(figs):
    rec = figs["recompute.png"].axes
    # the blocks' FLOPs counted too (issue 37): GFLOP, where the output head alone was MFLOP
    assert "MiB per rank" in rec[0].get_ylabel() and "GFLOP" in rec[1].get_ylabel()
    for ax in rec:  # no "1e-5" offset text over the title
        ax.figure.canvas.draw()
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_ylabel()


def _check_plot_layout(record, out_dir):
    """What issue 22 found in the CPU default's plots, on the figures themselves: units by
    magnitude, memory axes from zero, labels off the data, no zero-width phase listed."""
    from test_train_record import drawn_figures

    figs = drawn_figures(record, out_dir)
    phases = figs["compile_phases.png"].axes[0]
    listed = [t.get_text() for t in phases.get_legend().get_texts()]
    shown = record["engines"][0]["summary"]["compile_phases"]["phases"]
    assert "Inductor lowering + codegen" not in listed and len(listed) == \
        sum(v > 0.002 * sum(shown.values()) for v in shown.values()), listed
    assert phases.get_legend().get_bbox_to_anchor().x0 > phases.bbox.x1 - 1  # beside the bar
    mem = figs["memory.png"].axes
    assert all(ax.get_ylim()[0] == 0 for ax in mem)
    step = figs["step_memory.png"].axes[0]
    assert step.get_ylim()[0] == 0 and not step.texts  # no label drawn over the lines
    assert any("off scale" in t.get_text() for t in step.get_legend().get_texts())


def test_report_on_a_block_frames_run(one_rank_runs, tmp_path):
    """Issue 37: ``zbuf report`` on a ``--compile-structure blocks`` run said "no zbuf schedule
    in this record" and wrote 6 of the 7 plots: block frames' runtime schedule is the run's."""
    res, out = one_rank_runs["blocks"]
    assert res.returncode == 0, _why(res, out)
    summary = json.loads(out.read_text())["engines"][0]["summary"]
    assert summary["schedule_budget_bytes"] and summary["schedule_peak_live_bytes"], summary
    # The levels in force, and step 0's (every block recomputed) apart, as for the whole graph
    assert summary["recompute"]["regions_kept"] == 2, summary["recompute"]
    assert [(r["regions"], r["regions_recomputed"]) for r in summary["recompute_replaced"]] == \
        [(2, 2)], summary["recompute_replaced"]
    assert "before the re-plan: blocks" in " ".join(res.stdout.split()), res.stdout
    rep = _run(["report", str(out), "-o", str(tmp_path / "plots")], timeout=120,
               env={"COLUMNS": "200"})
    assert rep.returncode == 0, rep.stderr
    assert "no zbuf schedule" not in rep.stdout, rep.stdout
    assert "zbuf block frames: the runtime gather schedule" in rep.stdout, rep.stdout
    assert "blocks kept/selective/recomputed" in rep.stdout
    from test_readme import readme_report_plots
    from test_train_record import drawn_figures

    # The default run's plots, and what --ac auto kept and recomputed.
    assert sorted(os.listdir(tmp_path / "plots")) == sorted(readme_report_plots()
                                                           + ["recompute.png"])
    _check_recompute_layout(drawn_figures(json.loads(out.read_text()), tmp_path / "again"))


def test_two_steps_with_a_budget_below_the_floor(one_rank_runs):
    # --steps 2 failed on the default --warmup 3; --gather-budget 1 was raised to the schedule's
    # floor without a word. One rank keeps it short.
    res, out = one_rank_runs["floor"]
    assert res.returncode == 0, _why(res, out)
    note = "--gather-budget 1 B is below the schedule's floor"
    lines = res.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if note in line]
    first_step = next(i for i, line in enumerate(lines) if "step 1/2" in line)
    assert said and said[0] < first_step, res.stdout  # said as the run starts...
    assert len(said) == 2 and "note (zbuf): " + note in lines[said[1]]  # ...and under the table
    title = " ".join(res.stdout.split())
    assert "1 measured step" in title and "1 measured steps" not in title, res.stdout
    eng = json.loads(out.read_text())["engines"][0]
    assert eng["summary"]["warmup_steps"] == 1 and eng["summary"]["measured_steps"] == 1
    assert len(eng["notices"]) == 1 and note in eng["notices"][0]  # ...and in the record
    assert eng["summary"]["schedule_budget_bytes"] > 1


def test_bench_fsdp2_and_ddp_match_the_reference(tmp_path):
    out = tmp_path / "bench.json"
    steps = 4
    res = _run(["bench", "--engines", "fsdp2,ddp", "--steps", str(steps), "--warmup", "1",
                "--out", str(out)], env={"ZBUF_LOG_EXIT": "1"})
    assert res.returncode == 0, _why(res, out)
    _assert_clean_teardown(res, torch_keeps=True)  # fsdp2's ranks: DTensor's caches keep its mesh
    record = json.loads(out.read_text())
    _check_record(record, ["fsdp2", "ddp"], steps)
    # Same seed, same data, fp32 on CPU: every engine trains the unsharded reference model.
    ref = _reference_losses(steps)
    for eng in record["engines"]:
        _assert_matches_reference(eng["summary"]["losses"], ref)
    md = (tmp_path / "bench.md").read_text()
    assert "| fsdp2 |" in md and "| ddp |" in md and "torch 2." in md
    assert "First step by phase" in md and "| Dynamo tracing |" in md
    assert "relative to fsdp2" in res.stdout


def _dcp_tensors(path, tmp_path):
    """Every tensor of a DCP checkpoint (parameters and optimizer state), read without a
    process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_resume_under_torchrun_with_a_hugging_face_model_is_bit_exact(tmp_path, capsys):
    """Save at steps 3 and 6 (plain launcher); fresh processes under torchrun resume from the
    step-3 checkpoint alone and must reproduce steps 3..5 bit for bit: the same per-step losses
    and the same parameters and optimizer state in the step-6 checkpoint.

    One test for three requirements, to keep CI short: ``zbuf train`` runs unchanged under
    torchrun, ``--model hf:...`` trains through zbuf, and ``--checkpoint-dir/--save-every/
    --resume`` loses nothing."""
    pytest.importorskip("transformers")
    import torch

    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    common = ["train", "--engine", "zbuf-eager", "--model", "hf:qwen3", "--steps", "6",
              "--warmup", "1", "--save-every", "3"]
    res = _run(common + ["--checkpoint-dir", str(full_dir), "--collective-timeout", "120",
                         "--out", str(tmp_path / "full.json")])
    assert res.returncode == 0, _why(res, tmp_path / "full.json")
    full = json.loads((tmp_path / "full.json").read_text())
    _check_record(full, ["zbuf-eager"], 6)
    assert full["environment"]["collective_timeout_s"] == 120.0  # applied in the workers
    eng = full["engines"][0]
    assert eng["start_step"] == 0 and [c["step"] for c in eng["checkpoints"]] == [3, 6]
    assert sorted(os.listdir(full_dir)) == ["step_00000003", "step_00000006"]

    # Fresh processes that know only the step-3 checkpoint, launched by torchrun.
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "step_00000003", resumed_dir / "step_00000003")
    out = tmp_path / "resumed.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zbuf.cli", *common, "--resume", "--checkpoint-dir", str(resumed_dir),
           "--out", str(out)]
    env = dict(ENV, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, _why(res, out)
    shown = " ".join(res.stdout.split())  # rich wraps the table title on a narrow console
    assert "resuming after step 3" in shown and "resumed at step 3" in shown
    record = json.loads(out.read_text())
    assert record["model"]["name"].startswith("hf:qwen3")
    assert record["environment"]["collective_timeout_s"] == 600.0  # the documented default
    eng = record["engines"][0]
    assert eng["status"] == "ok", eng.get("error")
    assert eng["start_step"] == 3 and [s["step"] for s in eng["steps"]] == [3, 4, 5]
    assert eng["pool"]["hits"] > 0  # the HF model's weights went through zbuf
    assert eng["summary"]["measured_steps"] == 2
    assert [s["loss"] for s in eng["steps"]] == [s["loss"] for s in full["engines"][0]["steps"][3:]]
    assert [c["step"] for c in eng["checkpoints"]] == [6]
    a = _dcp_tensors(full_dir / "step_00000006", tmp_path)
    b = _dcp_tensors(resumed_dir / "step_00000006", tmp_path)
    assert a.keys() == b.keys() and any(k.startswith("optim") for k in a), sorted(a)[:5]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]

    # Restarting a finished run does nothing, successfully; a checkpoint past --steps is refused.
    from zbuf.cli import main

    args = ["train", "--engine", "zbuf-eager", "--model", "hf:qwen3", "--resume",
            "--checkpoint-dir", str(full_dir)]
    assert main(args + ["--steps", "6", "--out", str(tmp_path / "again.json")]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert not (tmp_path / "again.json").exists()
    assert main(args + ["--steps", "5", "--out", str(tmp_path / "again.json")]) == 2
    assert "past --steps 5" in " ".join(capsys.readouterr().err.split())

    # A damaged latest checkpoint stops every rank with the checkpoint's error and status 2, and
    # names the way back; --resume-from takes it (one rank: the same global batch of 16).
    shard = resumed_dir / "step_00000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    one_rank = ["--steps", "9", "--nproc", "1", "--micro-batch", "16", "--checkpoint-dir",
                str(resumed_dir)]
    res = _run(common + one_rank + ["--resume", "--out", str(tmp_path / "bad.json")])
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    said = " ".join(res.stderr.split())
    assert "zbuf train: error: --resume: step_00000006 in " in said and "Traceback" not in said
    # said once (rank 0's message), not again as "engine zbuf failed (exit 2): ranks 0-1 ...",
    # and no summary table of dashes claiming measured steps
    assert said.count("is damaged (__1_0.distcp is corrupted") == 1, res.stderr
    assert "failed (exit 2)" not in res.stderr and "measured step" not in res.stdout, res.stdout
    back = " ".join(["zbuf", *common, *one_rank, "--out", str(tmp_path / "bad.json"),
                     "--resume-from", "step_00000003"])
    assert said.endswith(f"To resume from the previous checkpoint step_00000003: {back}"), said
    assert not (tmp_path / "bad.json").exists()  # no record of a run that never started
    out = tmp_path / "back.json"
    res = _run(common + one_rank + ["--resume-from", "step_00000003", "--out", str(out)])
    assert res.returncode == 0, _why(res, out)
    eng = json.loads(out.read_text())["engines"][0]
    assert eng["start_step"] == 3 and eng["resumed_from"].endswith("step_00000003")
    # Saves at 6 and at the final step 9; retention kept the run's newest two, and the record
    # lists what exists.
    assert [c["step"] for c in eng["checkpoints"]] == [6, 9]
    assert sorted(p.name for p in resumed_dir.iterdir() if not p.name.startswith(".")) == \
        ["step_00000006", "step_00000009", "superseded"]
    assert (resumed_dir / "superseded" / "step_00000006" / "__1_0.distcp").read_bytes() == bytes(data)


def test_checkpoints_belong_to_one_run(tmp_path, capsys):
    """A run saves at its last step too, keeps only its own newest checkpoints, and lists only
    what exists; another run cannot start in its directory, and a resume with other settings is
    refused naming them (issue 15, item 3)."""
    from zbuf.cli import build_parser, main

    ck = tmp_path / "ck"
    base = ["train", "--engine", "zbuf-eager", "--warmup", "1", "--checkpoint-dir", str(ck)]
    out = tmp_path / "a.json"
    res = _run(base + ["--steps", "5", "--save-every", "2", "--out", str(out)])
    assert res.returncode == 0, _why(res, out)
    eng = json.loads(out.read_text())["engines"][0]
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000005"]
    assert [c["step"] for c in eng["checkpoints"]] == [4, 5] and eng["run_id"]

    def refused(args):
        assert main(base + args + ["--out", str(tmp_path / "b.json")]) == 2
        return " ".join(capsys.readouterr().err.split())

    # A new run in the directory: refused before anything starts; nothing deleted.
    err = refused(["--steps", "3", "--save-every", "1", "--seed", "1"])
    assert "already holds checkpoints (step_00000004, step_00000005)" in err and "--resume" in err
    # Resuming with other settings: refused, naming each difference and the way to allow it.
    err = refused(["--steps", "8", "--resume", "--seed", "1", "--lr", "0.001", "--task", "copy"])
    for part in ("--lr 0.003 there, 0.001 here", "--seed 0 there, 1 here",
                 "--task stride there, copy here", "--allow-change lr,seed,task"):
        assert part in err, err
    err = refused(["--steps", "8", "--resume", "--seed", "1", "--lr", "0.001", "--allow-change", "lr"])
    assert "--seed 0 there, 1 here" in err and "--lr" not in err.split("other settings:")[1], err
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000005"]
    assert not (tmp_path / "b.json").exists()
    # A damaged newest checkpoint: refused, naming it, what is wrong and the whole command that
    # resumes from the one before, not "zbuf train ..." (issue 37, items 2 and 11); nothing
    # deleted, no record written.
    for f in (ck / "step_00000005").iterdir():
        f.unlink()
    args = ["--steps", "8", "--resume"]
    err = refused(args)
    assert err.startswith("zbuf train: error: --resume: step_00000005 in "), err
    assert "is damaged (it is empty); nothing was loaded or deleted" in err, err
    back = " ".join(["zbuf", *base, *args[:-1], "--out", str(tmp_path / "b.json"),
                     "--resume-from", "step_00000004"])
    assert err.endswith(f"To resume from the previous checkpoint step_00000004: {back}"), err
    assert "..." not in err and "zbuf." not in err and "Error" not in err, err
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000005"]
    assert not (tmp_path / "b.json").exists()
    # Taking the way back keeps the damaged directory (moved aside) and the first record: the
    # resumed run writes its own beside it and says so (issue 37, item 3).
    before = out.read_bytes()
    res = _run(base + ["--steps", "6", "--save-every", "2", "--resume-from", "step_00000004",
                       "--out", str(out)])
    assert res.returncode == 0, _why(res)
    resumed = tmp_path / "a.from-step-4.json"
    said = " ".join(res.stdout.split())
    assert f"{out} keeps the record it holds, and this run's record goes to {resumed}" in said
    assert f"zbuf report {resumed}" in said, said
    assert out.read_bytes() == before
    assert [s["step"] for s in json.loads(resumed.read_text())["engines"][0]["steps"]] == [4, 5]
    assert (ck / "superseded" / "step_00000005").is_dir()
    helptext = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "--resume-from step_N" in helptext and "damaged" in helptext and "--allow-change" in helptext


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


LONG_RUN = ["train", "--engine", "zbuf-eager", "--steps", "100000", "--save-every", "2"]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "-m", "zbuf.cli"]


def _start_long_run(tmp_path, launcher=ZBUF):
    proc = subprocess.Popen(
        launcher + LONG_RUN + ["--checkpoint-dir", str(tmp_path / "ck"), "--out",
                               str(tmp_path / "cut.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(ENV, OMP_NUM_THREADS="1"),
        start_new_session=True,  # its own process group, like a shell job
        # a foreground job's SIGINT, not the one this runner inherited ([Note: an ignored
        # SIGINT stays ignored] in zbuf/faults.py)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # rank 0 prints this once every rank is set up and training
        if "training 100000 steps" in line:
            break
        assert time.monotonic() < deadline, "training never started"
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    while not (tmp_path / "ck" / "step_00000002").is_dir():  # a checkpoint to resume from
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint written"
        time.sleep(0.1)
    return proc, workers


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-launcher-only", "ctrl-c-under-torchrun"])
def test_interrupt_leaves_no_orphans_and_a_record(tmp_path, how):
    torchrun = how.endswith("torchrun")
    proc, workers = _start_long_run(tmp_path, TORCHRUN if torchrun else ZBUF)
    try:
        if how.startswith("ctrl-c"):  # the terminal sends SIGINT to the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        # 130 after Ctrl-C, 143 after SIGTERM, as shells report them (issue 37, item 10);
        # under torchrun, torchrun's own status
        assert proc.returncode == (1 if torchrun else 130 if how == "ctrl-c" else 143), rest
        assert "interrupted" in rest
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "orphaned workers"
        # [Note: interrupted runs]: the steps done, marked so, and the command that resumes
        assert (tmp_path / "cut.json").exists(), rest  # what the launcher and the ranks said
        with open(tmp_path / "cut.json") as f:
            eng = json.load(f)["engines"][0]
        assert eng["status"] == "interrupted" and len(eng["steps"]) >= 2, rest
        assert [s["step"] for s in eng["steps"]] == list(range(len(eng["steps"])))
        assert eng["summary"]["final_loss"] == eng["steps"][-1]["loss"]
        assert "interrupted" in rest.split("peak RSS")[0], rest  # the summary says so
        resume = " ".join([*(["torchrun <your torchrun options> -m zbuf.cli"] if torchrun
                             else ["zbuf"]), *LONG_RUN, "--checkpoint-dir", str(tmp_path / "ck"),
                           "--out", str(tmp_path / "cut.json"), "--resume"])
        assert f"resume with: {resume}" in rest, rest
        assert "latest checkpoint: " + str(tmp_path / "ck" / "step_0000") in rest, rest
        # Every rank's steps and the pool, not rank 0's alone and dashes; plotted, marked
        # interrupted (issue 37, item 3). Under torchrun no process sees the others' files.
        ranks = [0] if torchrun else [0, 1]
        assert [r["rank"] for r in eng["per_rank"]] == ranks, eng["per_rank"]
        assert all(len(s["alloc_retries"]) == len(ranks) for s in eng["steps"])
        assert eng["summary"]["pool"] and eng["summary"]["alloc_retries_per_rank"] == [0] * len(ranks)
        if how == "ctrl-c":
            from zbuf.cli import main

            assert main(["report", str(tmp_path / "cut.json"), "-o", str(tmp_path / "plots")]) == 0
            assert {"loss.png", "step_time.png", "memory.png"} <= set(os.listdir(tmp_path / "plots"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


SWALLOWED_STOP_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "swallowed_stop_job.py")


def test_ctrl_c_that_a_finaliser_swallowed_before_a_peer_stopped_leaves_the_record(tmp_path):
    """Under torchrun, rank 0's Ctrl-C lands in a finaliser (Python drops it) and its next
    collective fails because rank 1 stopped on its own Ctrl-C: the same interruption, so the run
    ends interrupted with the record of the steps done ([Note: a stop a peer's failure overtook]
    in zbuf/faults.py). Before, rank 0 exited 75 with the "another rank died" paragraph and wrote
    no record, the way ``test_interrupt_leaves_no_orphans_and_a_record[ctrl-c-under-torchrun]``
    failed under load; ``swallowed_stop_job.py`` replays that order at step 3."""
    out = tmp_path / "cut.json"
    res = subprocess.run(
        [*TORCHRUN[:-2], SWALLOWED_STOP_JOB, *LONG_RUN, "--checkpoint-dir", str(tmp_path / "ck"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(ENV, OMP_NUM_THREADS="1", ZBUF_TEST_STOP_STEP="3"),
        # the ranks take SIGINT as a terminal's Ctrl-C would ([Note: an ignored SIGINT stays
        # ignored] in zbuf/faults.py)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    rest = res.stdout + res.stderr
    assert res.returncode == 1, rest  # torchrun's own status: its ranks stopped
    assert "a finaliser swallowed rank 0's Ctrl-C" in rest, rest  # it was swallowed
    # and Python's "Exception ignored" traceback of it is not shown ([Note: what a stop leaves
    # unsaid] in zbuf/faults.py)
    assert "Exception ignored" not in rest, rest
    assert "another rank died" not in rest and "status 75" not in rest, rest
    # rank 1's exit makes torchrun SIGTERM rank 0, which may land first: either stop, said so
    assert "error: interrupted (SIG" in rest and "the record holds the steps done" in rest, rest
    assert out.exists(), rest
    eng = json.loads(out.read_text())["engines"][0]
    assert eng["status"] == "interrupted", eng
    assert [s["step"] for s in eng["steps"]] == [0, 1, 2], rest  # step 3 never finished
    assert "latest checkpoint: " + str(tmp_path / "ck" / "step_00000002") in rest, rest
