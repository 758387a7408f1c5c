"""``zbuf`` option handling: every bad option fails fast (no worker started) with a clear message
and a non-zero exit."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from zbuf.cli import build_parser, config_from_args, main
from zbuf.train.config import ConfigError, Engine, TrainConfig, parse_bytes


@pytest.mark.parametrize("argv, needle", [
    (["train", "--preset", "qwen9"], "unknown preset 'qwen9'"),
    (["train", "--model", "hf:Not-A-Type"], "model type"),
    (["train", "--global-batch", "2", "--nproc", "4"], "every rank needs at least one"),
    (["train", "--global-batch", "3", "--nproc", "2"], "does not split evenly"),
    (["train", "--micro-batch", "2", "--global-batch", "4"], "not both"),
    (["train", "--out", "/nonexistent-zbuf-dir/run.json"], "does not exist"),
    (["train", "--out", "/proc/zbuf-run.json"], "cannot write there"),
    (["train", "--mem-frac", "0.5", "--device", "cpu"], "no GPU"),
    (["train", "--engine", "ddp", "--gather-budget", "1GiB"],
     "has no meaning for engine(s) ddp: drop it, or add engine zbuf"),
    (["train", "--engine", "zbuf-eager", "--gather-budget", "1GiB"],
     "has no meaning for engine(s) zbuf-eager: use --pool-budget for zbuf-eager"),
    (["train", "--pool-budget", "1GiB"],
     "has no meaning for engine(s) zbuf: use --gather-budget for zbuf (its plan sizes the pool)"),
    (["bench", "--engines", "fsdp2,ddp", "--pool-budget", "1GiB"],
     "has no meaning for engine(s) fsdp2, ddp: drop it, or add engine zbuf-eager"),
    (["fit", "--engine", "zbuf-eager", "--gather-budget", "1GiB", "--simulate-world", "2",
      "--gpu-memory", "1GiB"], "use --pool-budget for zbuf-eager"),
    (["bench", "--engines", "fsdp2,ddp", "--optimizer-in-backward"],
     "engine(s) fsdp2, ddp step after backward: drop it, or use engine zbuf"),
    (["bench", "--engines", "fsdp2,ddp", "--offload-optimizer"],
     "engine(s) fsdp2, ddp keep theirs on the GPU: drop it, or add engine zbuf"),
    (["train", "--steps", "3", "--warmup", "3"], "no measured step"),
    (["train", "--seq-len", "2"], "at least 4"),
    (["train", "--seq-len", "4096"], "max_seq_len"),
    (["train", "--model", "tiny", "--preset", "qwen3-8b"], "disagree"),
    (["train", "--save-every", "3"], "need --checkpoint-dir"),
    (["train", "--resume"], "need --checkpoint-dir"),
    (["train", "--engine", "ddp", "--checkpoint-dir", "{tmp}/ck"], "engine(s) ddp cannot use"),
    (["train", "--engine", "fsdp2", "--checkpoint-dir", "{tmp}/ck", "--resume"],
     "engine(s) fsdp2 cannot use"),
    (["train", "--resume-from", "step_5"], "need --checkpoint-dir"),
    (["train", "--checkpoint-dir", "{tmp}/ck", "--resume-from", "latest"],
     "expected a checkpoint name"),
    (["train", "--checkpoint-dir", "{tmp}/ck", "--resume", "--allow-change", "lr,colour"],
     "--allow-change colour: not a setting that defines a run"),
    (["train", "--checkpoint-dir", "{tmp}/ck", "--allow-change", "lr"],
     "--allow-change applies to --resume"),
    (["train", "--checkpoint-dir", "/proc/zbuf-ckpt", "--save-every", "5"], "cannot write there"),
    (["train", "--checkpoint-dir", "{tmp}/file", "--resume"], "not a directory"),
])
def test_bad_option_clear_message_nonzero_exit(argv, needle, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "run.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run.json").exists()
    assert not (tmp_path / "ck").exists()  # refused before anything was created


def test_bench_refuses_checkpoints(tmp_path, capsys):
    from zbuf.train.runner import run

    cfg = TrainConfig(engines=(Engine.ZBUF_EAGER, Engine.ZBUF), checkpoint_dir=str(tmp_path),
                      save_every=2, out=str(tmp_path / "b.json"))
    assert run("bench", cfg) == 2
    assert "use zbuf train --checkpoint-dir" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(ConfigError, match="positive number of seconds"):
        TrainConfig(collective_timeout_s=0).validate()
    with pytest.raises(ConfigError, match="keep_last"):
        TrainConfig(checkpoint_dir=str(tmp_path), keep_checkpoints=0).validate()


@pytest.mark.parametrize("argv, needle", [
    (["train", "--mem-frac", "1.5"], "out of range"),
    (["train", "--mem-frac", "0"], "out of range"),
    (["train", "--micro-batch", "0"], "positive integer"),
    (["train", "--layers", "0"], "positive integer"),
    (["train", "--engine", "deepspeed"], "invalid choice"),
    (["bench", "--engines", "zbuf,megatron"], "unknown engine(s) megatron"),
    (["train", "--gather-budget", "lots"], "--gather-budget: cannot read 'lots' as a byte count"),
    (["train", "--pool-budget", "0"], "--pool-budget: byte count '0' must be positive"),
    (["train", "--save-every", "0"], "positive integer"),
    (["train", "--collective-timeout", "0"], "positive number"),
    (["train", "--collective-timeout", "soon"], "positive number"),
    (["bench", "--checkpoint-dir", "ck"], "unrecognized arguments"),
])
def test_argparse_level_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    # One line that matters, not argparse's usage block before it (issue 22 item 7).
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err


@pytest.mark.parametrize("argv", [["train", "--budget", "1GiB"], ["bench", "--budget=1"],
                                  ["fit", "--budget"], ["train", "--engine", "zbuf-eager",
                                                        "--budget", "lots"]])
def test_the_split_budget_names_both_replacements(argv, capsys):
    # --budget meant the gather budget for zbuf and the pool's cap for zbuf-eager; a script that
    # still passes it is told what each meaning is called now, whatever follows the flag.
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert (f"zbuf {argv[0]}: error: --budget was split in two: --gather-budget SIZE bounds "
            f"engine zbuf's gathered bytes, --pool-budget SIZE caps engine zbuf-eager's "
            f"gather-buffer pool") in err, err
    with pytest.raises(SystemExit):
        main([argv[0], "--help"])
    shown = capsys.readouterr().out  # hidden: --help shows the two that replaced it
    assert "--gather-budget SIZE" in shown and "--pool-budget SIZE" in shown
    assert " --budget" not in shown and "[--budget" not in shown


def test_each_budget_applies_to_its_own_engine():
    # One bench of both zbuf engines takes both budgets, each for its engine.
    TrainConfig(engines=(Engine.ZBUF, Engine.ZBUF_EAGER), gather_budget=1 << 30,
                pool_budget=1 << 28).validate()
    with pytest.raises(ConfigError, match="--pool-budget caps the zbuf-eager engine's"):
        TrainConfig(engines=(Engine.ZBUF,), pool_budget=1 << 28).validate()
    with pytest.raises(ConfigError, match=r"--gather-budget must be a positive byte count"):
        TrainConfig(gather_budget=-1).validate()


def test_budgets_reach_the_compiled_plan_and_the_eager_pool(one_rank_group, monkeypatch):
    # --gather-budget is zbuf.compile's budget_bytes and leaves the pool to the plan;
    # --pool-budget caps zbuf-eager's pool. Both given, as a bench of both engines may.
    import torch

    from zbuf.train import engines

    cfg = TrainConfig(engines=(Engine.ZBUF, Engine.ZBUF_EAGER), gather_budget=5 << 20,
                      pool_budget=3 << 20, steps=1, micro_batch=1, seq_len=8)
    cfg = cfg.resolve(cuda=False, world=1, bench=True)
    seen = {}

    def compile_model(model, **kwargs):  # the plan itself is tested in test_compile*.py
        seen.update(kwargs)
        return model

    monkeypatch.setattr(engines.zcompiled, "compile_model", compile_model)
    monkeypatch.setattr(engines.zcompiled, "step_memory_of", lambda compiled: None)
    cpu = torch.device("cpu")
    compiled = engines.build_engine(Engine.ZBUF, cfg, cpu)
    assert seen["budget_bytes"] == 5 << 20
    assert compiled.pool.stats().budget_bytes not in (3 << 20, 5 << 20)  # the pool's default
    eager = engines.build_engine(Engine.ZBUF_EAGER, cfg, cpu)
    assert eager.pool.stats().budget_bytes == 3 << 20
    default = engines.build_engine(Engine.ZBUF_EAGER, dataclasses.replace(cfg, pool_budget=None),
                                   cpu)
    assert default.pool.stats().budget_bytes == compiled.pool.stats().budget_bytes


def test_an_option_is_checked_by_one_definition():
    # [Note: one definition per option]: argparse and TrainConfig.validate share the field's
    # check, so a value set from Python gets the command line's message.
    with pytest.raises(SystemExit):
        main(["train", "--mem-frac", "1.5"])
    with pytest.raises(ConfigError, match=r"--mem-frac 1.5 is out of range"):
        TrainConfig(mem_frac=1.5).validate()
    with pytest.raises(ConfigError, match=r"--micro-batch must be a positive integer, got 0"):
        TrainConfig(micro_batch=0).validate()
    with pytest.raises(ConfigError, match=r"--dtype must be one of auto, bf16, fp32"):
        TrainConfig(dtype="fp8").validate()
    # Every field with an option is on the command line, with the field's default.
    import dataclasses

    from zbuf.train.options import cli_option

    for command in ("train", "bench"):
        args = build_parser().parse_args([command])
        for f in dataclasses.fields(TrainConfig):
            opt = cli_option(f)
            if opt is not None and command in opt.commands:
                default = getattr(f.default, "value", f.default)
                assert getattr(args, f.name) == default, (command, f.name)
        assert config_from_args(args) == TrainConfig(
            engines=config_from_args(args).engines)


def test_config_and_hf_import_no_cycle():
    # train/hf needs ConfigError; train/config needs check_hf_model: errors.py breaks the cycle.
    code = "import zbuf.train.hf, sys; assert 'zbuf.train.config' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_output_directory_is_rejected(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_console_script_exit_status():
    # The installed entry point, as a user runs it.
    out = subprocess.run([sys.executable, "-m", "zbuf.cli", "train", "--preset", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown preset 'nope'" in out.stderr and "tiny" in out.stderr


def test_config_resolution_and_bytes():
    cfg = TrainConfig().resolve(cuda=False, world=2, bench=False)
    assert (cfg.preset, cfg.nproc, cfg.dtype, cfg.ac, cfg.global_batch) == ("tiny", 2, "fp32",
                                                                           "off", 16)
    assert cfg.engines == (Engine.ZBUF,)
    gpu = TrainConfig(global_batch=8).resolve(cuda=True, world=4, bench=True)
    assert (gpu.micro_batch, gpu.dtype, gpu.ac, gpu.steps, gpu.warmup) == (2, "bf16", "full", 30, 10)
    assert TrainConfig.from_json(gpu.to_json()) == gpu
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5g") == 3 << 29 and parse_bytes("1000") == 1000
    with pytest.raises(ConfigError):
        parse_bytes("-1")


def test_report_rejects_what_is_not_a_record(tmp_path, capsys):
    bogus = tmp_path / "x.json"
    bogus.write_text('{"hello": 1}')
    assert main(["report", str(bogus)]) == 2
    assert "not a zbuf run record" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert os.listdir(tmp_path) == ["x.json"]


def test_report_on_a_directory_a_non_json_file_and_a_fit_record(tmp_path, capsys):
    """Issue 37: ``zbuf report /tmp`` said "cannot write plots to None: Is a directory"; a file
    holding ``not json {`` was called truncated; a fit record was "not a zbuf run record"
    without a word of what it is."""
    (tmp_path / "zbuf-bench.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{tmp_path} is a directory; give the run record's file, e.g. zbuf report " \
           f"{tmp_path / 'zbuf-bench.json'}" in line and "None" not in line, line
    junk = tmp_path / "junk.json"
    junk.write_text("not json {")
    assert main(["report", str(junk)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{junk} is not a zbuf run record: not JSON" in line and "truncated" not in line, line
    fit = tmp_path / "zbuf-fit.json"
    fit.write_text(json.dumps({"schema": "zbuf.fit/1", "micro_batch": 6, "probes": []}))
    assert main(["report", str(fit)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{fit} is a zbuf fit record, not a run record: its search found 6 the largest " \
           "micro-batch that fits" in line, line
    assert sorted(os.listdir(tmp_path)) == ["junk.json", "zbuf-bench.json", "zbuf-fit.json"]


def test_help_does_not_import_torch():
    # zbuf --help took 3 s: torch imported for nothing ([Note: lazy import] in zbuf/__init__.py).
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "zbuf.cli", "train", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--nproc" in out.stdout, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "zbuf.train.config" in imported  # the options were built
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, \
        sorted(m for m in imported if m.startswith("torch"))[:5]


@pytest.mark.parametrize("args", [
    ["train", "--preset", "qwen9"],
    ["bench", "--engines", "fsdp2", "--gather-budget", "1GiB"],
    ["train", "--micro-batch", "2", "--global-batch", "8"],
])
def test_a_bad_option_is_refused_without_importing_torch(args):
    # A refusal that needs no machine took 4-10 s (--preset qwen9: 8.5 s), torch imported
    # first; now it comes before (issue 37, item 13).
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "zbuf.cli", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith(f"zbuf {args[0]}: error: "), said
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "torch" not in imported, sorted(m for m in imported if m.startswith("torch"))[:5]


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if the run gets as far as starting workers."""
    import zbuf.train.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("workers were started; the options should have been refused first")

    monkeypatch.setattr(runner, "launch_group", refuse)


def _one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_rank_count_the_machine_cannot_hold_is_refused_up_front(no_spawn, capsys, tmp_path,
                                                                 monkeypatch):
    # 64 CPU ranks on a 23 GiB machine ran 7 minutes into the OOM killer. 4096 tiny ranks need
    # about 2 TiB: no machine that runs this suite has that.
    out = str(tmp_path / "run.json")
    assert main(["train", "--nproc", "4096", "--out", out]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--nproc 4096: 4096 CPU ranks need about" in line and "is available" in line, line
    assert "use --nproc" in line and not os.path.exists(out)

    # The count that fits is the one the message names.
    from zbuf.train.resources import SHARED_BYTES, check_cpu_memory, cpu_rank_bytes

    cfg = TrainConfig(nproc=64).resolve(cuda=False, world=64, bench=False)
    avail = SHARED_BYTES + 10 * cpu_rank_bytes(cfg, 10) + 1
    with pytest.raises(ConfigError, match=r"use --nproc 10 or fewer"):
        check_cpu_memory(cfg, available=avail, cores=64)
    check_cpu_memory(dataclasses.replace(cfg, nproc=10), available=avail)  # fits: no error
    # ... capped at the cores: 10 fit in memory, but 2 cores run 10 ranks 5x slower
    with pytest.raises(ConfigError, match=r"use --nproc 2 or fewer \(10 would fit in memory, "
                                          r"but on 2 CPU cores more ranks only share them"):
        check_cpu_memory(cfg, available=avail, cores=2)
    big = TrainConfig(preset="qwen3-8b", nproc=1).resolve(cuda=False, world=1, bench=False)
    with pytest.raises(ConfigError, match="even one rank does not fit"):
        check_cpu_memory(big, available=16 << 30)

    # More ranks than cores run, with a note of what they cost ([Note: CPU ranks and cores]).
    from zbuf.train.resources import cpu_oversubscription

    assert cpu_oversubscription(dataclasses.replace(cfg, nproc=2), cores=2) is None
    assert cpu_oversubscription(dataclasses.replace(cfg, nproc=45), cores=2) == (
        "--nproc 45 on 2 CPU cores: the ranks share the cores, so each step takes about 22.5x "
        "as long as with a core per rank; --nproc 2 uses each core once")

    # GPUs: one rank per GPU.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["train", "--nproc", "4", "--out", out]) == 2
    assert "--nproc 4 but only 2 GPU(s) visible" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("model, says", [
    ("hf:foobar", "no transformers model type is called 'foobar'"),
    ("hf:gpt2", "transformers has model type 'gpt2', but zbuf does not support it"),
])
def test_hugging_face_model_type_is_checked_before_spawning(model, says, no_spawn, capsys,
                                                           tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    out = str(tmp_path / "run.json")
    assert main(["train", "--model", model, "--out", out]) == 2
    line = _one_line(capsys.readouterr().err)
    assert says in line and "zbuf supports hf:llama and hf:qwen3" in line, line

    # A supported type without transformers: the install extra, by name.
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    assert main(["train", "--model", "hf:qwen3", "--out", out]) == 2
    line = _one_line(capsys.readouterr().err)
    # zbuf is not on the package index: 'zbuf[hf]' named a package pip cannot find
    assert "needs the transformers package: pip install transformers (from a zbuf checkout: " \
           "pip install '.[hf]')" in line and "zbuf[hf]" not in line, line


def test_default_warmup_follows_the_steps():
    # --steps 2 failed on a default --warmup 3 the user never set.
    for steps, bench, warmup in ((2, False, 1), (1, False, 0), (5, False, 2), (30, False, 3),
                                 (12, True, 6), (30, True, 10)):
        cfg = TrainConfig(steps=steps).resolve(cuda=False, world=2, bench=bench)
        assert cfg.warmup == warmup, (steps, bench, cfg.warmup)
    with pytest.raises(ConfigError, match="no measured step"):  # an explicit one stays checked
        TrainConfig(steps=2, warmup=2).resolve(cuda=False, world=2, bench=False)


def test_report_names_the_damaged_file_and_the_cause(tmp_path, capsys):
    good = json.dumps({"schema": "zbuf.run/1", "engines": [], "config": {"steps": 30}})
    cut = tmp_path / "cut.json"
    cut.write_text(good[: len(good) // 2])
    assert main(["report", str(cut)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(cut) in line and "truncated" in line, line
    # json's own words end in "at" here: "starting at: line 1, column 27", not "at at line 1"
    assert "Unterminated string starting at: line 1, column 26" in line and "at at" not in line
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "zbuf.run/1",, }')
    assert main(["report", str(bad)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(bad) in line and "not valid JSON" in line and "line 1, column" in line, line
    mangled = tmp_path / "mangled.json"
    mangled.write_text(json.dumps({"schema": "zbuf.run/1"}))
    assert main(["report", str(mangled)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(mangled) in line and "not a complete zbuf run record" in line, line


@pytest.mark.parametrize("first", ["zbuf", "torch"])
def test_import_order(first):
    # Whichever comes first, once torch is imported zbuf is loaded, with the torch modules it
    # needs, before init_process_group can be called ([Note: lazy import] in zbuf/__init__.py).
    second = "torch" if first == "zbuf" else "zbuf"
    code = f"""
import sys
import {first}
import {second}
import torch.distributed as dist
assert not dist.is_initialized()
loaded = [m for m in ("zbuf.shard", "zbuf.compile", "zbuf.checkpoint", "zbuf.pool",
                      "torch.distributed.nn.functional") if m not in sys.modules]
assert not loaded, loaded
assert torch.__spec__.loader is torch.__loader__ and "zbuf" not in type(torch.__loader__).__module__
assert callable(zbuf.shard) and zbuf.ShardingError is sys.modules["zbuf.shard"].ShardingError
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_ac_modes_and_per_engine_modes():
    """--ac takes a mode (bare --ac: full), --no-ac is off; --engines ENGINE:MODE gives one run its
    own mode; auto is the zbuf compiler's and refused, with the fix, for engines without it."""
    def cfg_of(*argv, cuda=True, world=2):
        args = build_parser().parse_args(list(argv))
        return config_from_args(args).resolve(cuda=cuda, world=world, bench=args.command == "bench")

    assert cfg_of("train", "--ac").ac == "full"
    assert cfg_of("train", "--no-ac").ac == "off"
    assert cfg_of("train", "--ac", "auto").ac == "auto"
    assert cfg_of("train").ac == "full" and cfg_of("train", cuda=False).ac == "off"
    cfg = cfg_of("bench", "--engines", "zbuf:auto,fsdp2,fsdp2:selective", "--ac")
    assert cfg.runs() == [(Engine.ZBUF, "auto"), (Engine.FSDP2, "full"),
                          (Engine.FSDP2, "selective")]
    assert cfg.run_labels() == ["zbuf:auto", "fsdp2:full", "fsdp2:selective"]
    one = cfg.for_run(2)
    assert (one.engines, one.ac, one.engine_ac) == ((Engine.FSDP2,), "selective", ())
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert cfg_of("bench", "--engines", "zbuf,fsdp2", "--ac", "selective").run_labels() == [
        "zbuf", "fsdp2"]
    with pytest.raises(ConfigError, match=r"--ac auto .* engine\(s\) fsdp2 have .*fsdp2:selective"):
        cfg_of("bench", "--engines", "zbuf,fsdp2", "--ac", "auto")
    with pytest.raises(ConfigError, match="engine-eager|zbuf-eager"):
        cfg_of("train", "--engine", "zbuf-eager", "--ac", "auto")
    with pytest.raises(ConfigError, match="fsdp2:full listed twice"):
        cfg_of("bench", "--engines", "fsdp2,fsdp2:full", "--ac")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--engines", "zbuf:sometimes"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--ac", "sometimes"])
    # Records written before the modes: a bool.
    old = cfg.to_json() | {"ac": True, "engine_ac": []}
    assert TrainConfig.from_json(old).ac == "full"


def test_more_cpu_ranks_than_cores_start_with_a_note_of_the_cost(monkeypatch, capsys, tmp_path):
    # --nproc 64 on 2 cores was refused for memory only, suggesting 45 ranks on 2 cores.
    import zbuf.train.resources as resources
    import zbuf.train.runner as runner

    class Started(Exception):
        pass

    def launched(*args, **kwargs):
        raise Started

    monkeypatch.setattr(resources, "host_cores", lambda: 1)
    monkeypatch.setattr(runner, "launch_group", launched)
    with pytest.raises(Started):
        main(["train", "--nproc", "2", "--out", str(tmp_path / "run.json")])
    out = capsys.readouterr().out
    assert "zbuf train: note: --nproc 2 on 1 CPU core: the ranks share the cores, so each step " \
           "takes about 2x as long" in out, out
