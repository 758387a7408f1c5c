"""Simulated ranks (``--simulate-world N``, [Note: simulated ranks] in zbuf/train/simulate.py),
``--gpu-memory`` and ``zbuf fit`` ([Note: fitting a micro-batch] in zbuf/train/fit.py), on CPU."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from started import Started
from zbuf.cli import main
from zbuf.train.config import ConfigError, Engine, TrainConfig

_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "zbuf.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=_ENV)


def _started(argv, where, name) -> Started:
    """``zbuf ARGV`` started in the background (tests/started.py)."""
    return Started([sys.executable, "-m", "zbuf.cli", *argv], where, name, _ENV)


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if the run gets as far as starting workers."""
    import zbuf.train.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("workers were started; the options should have been refused first")

    monkeypatch.setattr(runner, "launch_group", refuse)


@pytest.mark.parametrize("argv, needle", [
    (["--simulate-world", "0"], "--simulate-world must be a positive integer, got 0"),
    (["--simulate-world", "-3"], "--simulate-world must be a positive integer, got -3"),
    (["--simulate-world", "two"], "--simulate-world must be a positive integer, got 'two'"),
    (["--gpu-memory", "lots"], "cannot read 'lots' as a byte count"),
    (["--gpu-memory", "0"], "must be positive"),
    (["--link-gbps", "0"], "--link-gbps must be a positive number"),
])
@pytest.mark.parametrize("command", ["train", "bench", "fit"])
def test_unreadable_simulation_options_are_one_line(command, argv, needle, capsys, no_spawn):
    with pytest.raises(SystemExit) as exc:
        main([command, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, needle", [
    (["--simulate-world", "1"], "--simulate-world 1 is one real rank"),
    (["--simulate-world", "4", "--nproc", "2"], "--nproc 2 would start real ranks"),
    (["--simulate-world", "4", "--gpu-memory", "100TiB"], "is more than this machine's"),
    (["--gpu-memory", "8GiB", "--mem-frac", "0.5"], "give one"),
])
@pytest.mark.parametrize("command", ["train", "bench"])
def test_simulation_options_that_cannot_work_are_refused_before_workers(command, argv, needle,
                                                                        capsys, no_spawn,
                                                                        tmp_path):
    out = str(tmp_path / "run.json")
    assert main([command, *argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out)


def test_simulated_run_keeps_no_checkpoints(capsys, no_spawn, tmp_path):
    assert main(["train", "--simulate-world", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "r.json")]) == 2
    assert "drop --checkpoint-dir" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_simulated_run_refused_under_torchrun(monkeypatch, capsys, no_spawn):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("ZBUF_LAUNCHER_PID", raising=False)
    assert main(["train", "--simulate-world", "4"]) == 2
    assert "start it without torchrun" in capsys.readouterr().err


def test_gpu_memory_larger_than_the_card(monkeypatch, tmp_path, capsys):
    # CUDA: the size becomes the fraction of the card torch reports; above it, refused.
    import torch

    from zbuf.train import runner

    class Props:
        total_memory = 140 << 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    cfg = TrainConfig(gpu_memory=80 << 30, simulate_world=8, device="cuda")
    cfg = cfg.resolve(cuda=True, world=8, bench=False)
    assert runner._emulated_card(cfg).mem_frac == pytest.approx(80 / 140)
    with pytest.raises(ConfigError, match=r"--gpu-memory 200.00 GiB is more than this GPU's "
                                          r"140.00 GiB \(NVIDIA H200\)"):
        runner._emulated_card(TrainConfig(gpu_memory=200 << 30, device="cuda").resolve(
            cuda=True, world=1, bench=False))


def _check_simulated_record(path, engines, steps):
    record = json.loads(open(path).read())
    assert record["simulated"]["world_size"] == 4 and record["world_size"] == 4
    assert "losses are not meaningful" in record["simulated"]["note"]
    assert record["simulated"]["link_gbps"] == record["simulated"]["link_gbps_default"] == 3600
    assert record["config"]["simulate_world"] == 4
    for eng, name in zip(record["engines"], engines):
        assert eng["engine"] == name and eng["status"] == "ok", eng.get("error")
        assert len(eng["steps"]) == steps and len(eng["per_rank"]) == 1  # rank 0 only
        comm = eng["communication"]
        moved = comm["all_gather_bytes"] + comm["reduce_scatter_bytes"] + comm["all_reduce_bytes"]
        assert moved > 0 and comm["seconds"] > 0, comm
        # An estimate beside the step time, never inside it.
        assert all(s["time_s"] != s["time_s"] + comm["seconds"] for s in eng["steps"])
    return record


@pytest.fixture(scope="module")
def simulated_runs(tmp_path_factory):
    """``zbuf train`` and ``zbuf bench`` at ``--simulate-world 4`` (then ``zbuf report`` of
    train's record), for the two tests below: started together, since each runs one worker
    process at a time, so CI's two cores take them in about the time of the longer one.

    Returns ``{name: (completed process, record path)}``."""
    where = tmp_path_factory.mktemp("simulated")
    common = ["--simulate-world", "4", "--micro-batch", "2", "--seq-len", "32", "--no-progress"]
    train = _started(["train", *common, "--steps", "2", "--gpu-memory", "64MiB", "--out",
                      str(where / "sim.json")], where, "train")
    bench = _started(["bench", *common, "--engines", "zbuf,fsdp2,ddp", "--steps", "2", "--out",
                      str(where / "bench.json")], where, "bench")
    try:
        runs = {"train": (train.result(timeout=600), where / "sim.json")}
        report = _started(["report", str(where / "sim.json"), "-o", str(where / "plots")], where,
                          "report")
        runs["report"] = (report.result(timeout=300), where / "plots")
        runs["bench"] = (bench.result(timeout=600), where / "bench.json")
    finally:
        for started in (train, bench):
            if started.proc.poll() is None:
                started.proc.kill()
                started.proc.wait()
    return runs


def test_train_simulate_world_4(simulated_runs):
    res, out = simulated_runs["train"]
    assert res.returncode == 0, res.stderr[-3000:]
    record = _check_simulated_record(out, ["zbuf"], 2)
    # On CPU the card is zbuf's stand-in: the schedule is planned within it (18 GiB without).
    assert record["config"]["gpu_memory"] == 64 << 20
    assert 0 < record["engines"][0]["summary"]["schedule_budget_bytes"] < 64 << 20
    comm = record["engines"][0]["communication"]
    assert comm["source"].startswith("counted")
    assert "SIMULATED ranks" in res.stdout and "SIMULATED: simulated ranks: rank 0 of 4" in \
        " ".join(res.stdout.split()), res.stdout
    rep, _ = simulated_runs["report"]
    assert rep.returncode == 0 and "SIMULATED" in rep.stdout, rep.stderr[-2000:]


def test_bench_simulate_world_4_three_engines(simulated_runs):
    res, out = simulated_runs["bench"]
    assert res.returncode == 0, res.stderr[-3000:]
    record = _check_simulated_record(out, ["zbuf", "fsdp2", "ddp"], 2)
    fsdp2, ddp = record["engines"][1]["communication"], record["engines"][2]["communication"]
    params = record["model"]["params"]
    assert ddp["all_reduce_bytes"] == 4 * params  # fp32 gradients, whole model
    assert fsdp2["reduce_scatter_bytes"] == 4 * params
    md = out.with_suffix(".md").read_text()
    assert "**SIMULATED: simulated ranks: rank 0 of 4" in md and "communication" in md.lower()
    # The reference configuration's table (benches/reference_table.py): one row per engine.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benches"))
    try:
        import reference_table
    finally:
        sys.path.pop(0)
    text = reference_table.table([record])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "(simulated)" in line]
    assert [r.split(" |")[0][2:] for r in rows] == ["zbuf (simulated)", "fsdp2 (simulated)",
                                                    "ddp (simulated)"], text
    assert all(r.count("|") == 11 and "Gbit/s" in r for r in rows), text


# ---------------------------------------------------------------------------------------------
# rank 0's bytes: simulated == real


def _holdings(rank, world, engines):
    """Rank 0's parameter, gradient and optimizer-state bytes after one step, per engine."""
    import torch
    import torch.distributed as dist

    from zbuf.train.engines import build_engine
    from zbuf.train.data import rank_batch

    def local(t):
        inner = getattr(t, "_local_tensor", t)
        return inner.numel() * inner.element_size()

    simulated = dist.get_backend() == "fake"
    out = {}
    for name in engines:
        torch._dynamo.reset()
        cfg = TrainConfig(engines=(Engine(name),), steps=1, micro_batch=1, seq_len=8,
                          simulate_world=world if simulated else None, compiler="aot_eager")
        cfg = cfg.resolve(cuda=False, world=world, bench=False)
        setup = build_engine(Engine(name), cfg, torch.device("cpu"))
        meta = any(p.is_meta for p in setup.model.parameters())
        batch = rank_batch(cfg.task, cfg.seed, 0, 1, world, rank, cfg.seq_len, 256,
                           torch.device("cpu"))
        setup.step_loss(batch).backward()
        grads = sum(local(p.grad) for p in setup.model.parameters() if p.grad is not None)
        setup.optimizer.step()
        state = sum(local(v) for st in setup.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        rows = sum(p.numel() // max(1, p.shape[0]) * 4 for p in setup.model.parameters())
        out[name] = {"params": sum(local(p) for p in setup.model.parameters()), "grads": grads,
                     "state": state, "meta_left": meta, "row_bytes": rows,
                     "tensors": len(list(setup.model.parameters()))}
    return out if rank == 0 else None


_HOLDING_ENGINES = ("zbuf-eager", "fsdp2")
_HOLDING_WORLDS = (2, 3)


def _simulated(worlds, engines):
    from zbuf.train.simulate import simulate_world

    held = {}
    for world in worlds:  # one after the other: each world's fake group is the default group
        with simulate_world(world):
            held[world] = _holdings(0, world, engines)
    return held


@pytest.fixture(scope="module")
def simulated_rank0():
    """Rank 0's holdings under ``simulate_world(N)`` for every N tested, from one spawned
    process (not this one: the fake group would be its default group), started once; the
    pending result, which works beside the first test's real ranks (one process to their N,
    on CI's two cores)."""
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool.apply_async(_simulated, (_HOLDING_WORLDS, _HOLDING_ENGINES))


@pytest.mark.parametrize("world", _HOLDING_WORLDS)
def test_rank0_holds_what_a_real_rank0_holds(world, simulated_rank0):
    engines = _HOLDING_ENGINES
    real = run_distributed(_holdings, world, engines)[0]
    sim = simulated_rank0.get(timeout=600)[world]
    from zbuf.presets import resolve_config

    unsharded = 4 * resolve_config("tiny").num_params()
    for name in engines:
        assert sim[name] == real[name], (name, sim[name], real[name])
        held = sim[name]
        assert not held["meta_left"]
        # 1/N of the model's bytes, within padding (at most one row per parameter per rank).
        for kind in ("params", "grads"):
            assert unsharded <= world * held[kind] <= unsharded + world * held["row_bytes"], \
                (name, kind, held[kind] * world, unsharded)
        steps = world * 8 * held["tensors"]  # AdamW's step counts, one scalar per tensor
        assert 2 * unsharded <= world * held["state"] <= 2 * (
            unsharded + world * held["row_bytes"]) + steps, (name, held["state"] * world)


def test_simulate_world_helper_refuses_what_cannot_work():
    from zbuf.train.simulate import simulate_world

    with pytest.raises(ValueError, match="simulate 2 or more ranks"):
        with simulate_world(1):
            pass


# ---------------------------------------------------------------------------------------------
# zbuf fit


def test_fit_on_cpu_finds_a_micro_batch_and_a_smaller_card_a_smaller_one(tmp_path):
    # The CPU card is the stand-in (peak RSS): a huge card fits the largest micro-batch tried,
    # a card between the peaks of micro-batches 1 and 2 fits 1. One layer and long sequences,
    # so that a sequence's activations stand out of the runtime's resident memory.
    base = ["fit", "--preset", "tiny", "--layers", "1", "--engine", "zbuf-eager",
            "--simulate-world", "2", "--seq-len", "2048", "--steps", "2",
            "--max-micro-batch", "2", "--probe-timeout", "300"]
    big = tmp_path / "big.json"
    res = _cli(base + ["--gpu-memory", "16GiB", "--out", str(big)])
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    found = json.loads(big.read_text())
    assert found["schema"] == "zbuf.fit/1" and found["micro_batch"] == 2, found
    peaks = {p["micro_batch"]: p["peak_bytes"] for p in found["probes"]}
    assert set(peaks) == {1, 2} and peaks[2] > peaks[1], peaks
    assert all(p["headroom_bytes"] == (16 << 30) - p["peak_bytes"] for p in found["probes"])
    # Each step's retries (none on CPU); the eager engine has no block frames to report.
    assert all(p["retries_by_step"] == [0, 0] and p["activations"] is None
               for p in found["probes"]), found["probes"]
    assert "largest micro-batch that fits: 2" in res.stdout and "headroom" in res.stdout
    # On CPU the peak is the probe process's resident memory, and fit says so (issue 37).
    assert "peak RSS is the probe process's peak resident memory" in res.stdout, res.stdout
    assert "  micro-batch    1: fits  peak RSS " in res.stdout, res.stdout

    small = tmp_path / "small.json"
    card = (peaks[1] + peaks[2]) // 2
    res = _cli(base + ["--gpu-memory", str(card), "--out", str(small)])
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    found = json.loads(small.read_text())
    # Peak RSS is re-measured by every probe, and its noise can exceed half the gap between
    # micro-batches 1 and 2 on a loaded machine (seen once in a full suite run: 2 fit the
    # midpoint card). What fit guarantees holds whatever the noise: the answer is the largest
    # probe that fit, every probe that fit is within the card, every other is over it.
    fits = {p["micro_batch"]: p for p in found["probes"]}
    assert found["micro_batch"] == max(m for m, p in fits.items() if p["fits"]), found
    assert found["micro_batch"] <= 2 and found["card_bytes"] == card, found
    for p in fits.values():
        assert p["peak_bytes"] <= card if p["fits"] else \
            re.search(r"is .* over the .* card$", p["why"]), p
    if found["micro_batch"] == 2:  # the noisy case: micro-batch 2 did fit the midpoint here
        assert fits[2]["peak_bytes"] <= card < peaks[2], (fits, peaks)


def test_fit_options_say_what_fit_does(capsys, monkeypatch):
    """Issue 37: a minimum above the maximum was accepted (and answered the maximum); ``fit
    --help`` gave --steps train's default of 30 where fit runs 5; "peak 1.00 GiB is over the
    card" on a card of 1.00 GiB."""
    from zbuf.cli import main
    from zbuf.train.fit import verdict

    assert main(["fit", "--simulate-world", "2", "--gpu-memory", "1GiB",
                 "--min-micro-batch", "10", "--max-micro-batch", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["zbuf fit: error: --min-micro-batch 10 is above --max-micro-batch 2: the "
                   "search runs from the first up to the second; give a minimum no larger than "
                   "the maximum"], err
    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps "warm-up" at its hyphen
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS steps per probe, warm-up included (default 5: 2 warm-up + 3 measured)" \
        in text and "(default 30)" not in text, text
    # --out: fit writes its record whether or not it is given (the README said "with --out")
    assert "--out RUN.json JSON record of the search, every probe in it (default zbuf-fit.json)" \
        in text, text
    assert verdict((1 << 30) + (5 << 20), 1 << 30, 0) == \
        "peak 1.00 GiB is 5.00 MiB over the 1.00 GiB card"
    assert verdict(1 << 30, 1 << 30, 0) == "fits"
    assert verdict(1 << 20, 1 << 30, 2) == "2 allocator retries after warm-up"


def test_fit_probe_time_limit_ends_the_probe_not_the_search(tmp_path):
    from zbuf.train import fit

    cfg = TrainConfig(engines=(Engine.ZBUF_EAGER,), simulate_world=2, gpu_memory=16 << 30,
                      steps=2).resolve(cuda=False, world=2, bench=False)
    p = fit.probe(cfg, 1, timeout_s=0.5)  # far less than a process start
    assert not p.fits and "no result within 0.5 s" in p.why and p.seconds < 30


def test_a_probe_says_where_its_retries_fell_and_what_its_plan_did_with_the_activations():
    """A fit answer is read with what made it: a probe whose retries stopped in its warm-up
    fits, one still retrying in its last step does not, and the blocks' levels and offloaded
    calls say why a smaller micro-batch steps faster per sample (benches/results/fit.md: qwen3-32b
    at micro-batch 4 took 1.47 s a sample, at 5-7 1.82-1.83 s)."""
    from zbuf.train.fit import read_probe

    def record(cumulative, levels, offloaded):
        steps = [{"time_s": 1.0 + i, "alloc_retries": [n, 7]} for i, n in enumerate(cumulative)]
        return {"per_rank": [{"peak_device_bytes": 70, "alloc_retries_total": cumulative[-1],
                              "alloc_retries_measured": cumulative[-1] - cumulative[2]}],
                "warmup_steps": 3, "steps": steps,
                "schedule": {"blocks": {"levels": levels,
                                        "activation_offload": {"blocks": offloaded}}}}

    levels = ["recompute"] * 4 + ["selective", "recompute", "selective", "recompute"]
    settled = read_probe(4, record([0, 1, 2, 2, 2, 2], levels, [4, 6]), 80, 60.0)
    assert settled.fits and settled.retries_by_step == [0, 1, 1, 0, 0, 0]
    assert settled.activations == {"recompute": 6, "selective": 2, "keep": 0, "offloaded": 2}
    assert settled.headroom_bytes == 10 and settled.step_time_s == 5.0
    still = read_probe(5, record([0, 1, 2, 3, 4, 5], ["recompute"] * 8, []), 80, 60.0)
    assert not still.fits and still.retries_by_step == [0, 1, 1, 1, 1, 1]
    assert still.why == "3 allocator retries after warm-up"
    assert still.activations == {"recompute": 8, "selective": 0, "keep": 0, "offloaded": 0}
    graph = read_probe(4, {**record([0] * 6, [], []), "schedule": {"graphs": []}}, 80, 1.0)
    assert graph.activations is None


def test_fit_prints_what_the_plan_did_with_the_blocks(tmp_path, capsys, monkeypatch):
    """The probe's line names the blocks' levels once the plan moved any off level 0, and the
    record keeps each step's retries."""
    from zbuf.train import fit

    def probe(cfg, mb, timeout_s):
        moved = {"recompute": 52, "selective": 12, "keep": 0, "offloaded": 12}
        as_checkpointed = {"recompute": 64, "selective": 0, "keep": 0, "offloaded": 0}
        if mb == 1:
            return fit.Probe(mb, True, "fits", 70, 10, 0, 0, 1.0, 2.0, None, [0, 0], moved)
        return fit.Probe(mb, False, "1 allocator retries after warm-up", 75, 5, 0, 1, 1.5, 2.0,
                         None, [0, 1], as_checkpointed)

    monkeypatch.setattr(fit, "probe", probe)
    out = tmp_path / "fit.json"
    assert main(["fit", "--simulate-world", "2", "--gpu-memory", "1GiB", "--max-micro-batch",
                 "2", "--out", str(out)]) == 0
    lines = {int(line.split(":")[0].split()[-1]): line
             for line in capsys.readouterr().out.splitlines()
             if line.startswith("  micro-batch ")}
    assert lines[1].endswith("  blocks: 52 recompute, 12 selective (12 offloaded)"), lines
    assert "blocks:" not in lines[2], lines
    assert [p["retries_by_step"] for p in json.loads(out.read_text())["probes"]] == [[0, 0],
                                                                                    [0, 1]]


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 8), (3, 16), (4, 5)])
def test_fit_search_finds_the_largest_that_fits_each_micro_batch_tried_once(lo, hi, monkeypatch):
    from zbuf.train import fit

    for limit in range(0, 18):
        tried = []

        def probe(cfg, mb, timeout_s, limit=limit):
            tried.append(mb)
            return fit.Probe(mb, mb <= limit, "fits" if mb <= limit else "out of memory",
                             None, None, None, None, None, 0.0)

        monkeypatch.setattr(fit, "probe", probe)
        found = fit.fit(None, max_micro_batch=hi, timeout_s=1, min_micro_batch=lo)
        assert found.micro_batch == min(limit, hi), (limit, tried)
        assert len(tried) == len(set(tried)) and all(1 <= mb <= hi for mb in tried)
