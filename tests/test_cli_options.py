"""``zbuf`` option handling: every bad option fails fast (no worker started) with a clear message
and a non-zero exit."""

import os
import subprocess
import sys

import pytest

from zbuf.cli import main
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
    (["train", "--engine", "ddp", "--budget", "1GiB"], "has no meaning"),
    (["train", "--steps", "3", "--warmup", "3"], "no measured step"),
    (["train", "--seq-len", "2"], "at least 4"),
    (["train", "--seq-len", "4096"], "max_seq_len"),
    (["train", "--model", "tiny", "--preset", "qwen3-8b"], "disagree"),
    (["train", "--save-every", "3"], "need --checkpoint-dir"),
    (["train", "--resume"], "need --checkpoint-dir"),
    (["train", "--engine", "ddp", "--checkpoint-dir", "{tmp}/ck"], "engine(s) ddp cannot use"),
    (["train", "--engine", "fsdp2", "--checkpoint-dir", "{tmp}/ck", "--resume"],
     "engine(s) fsdp2 cannot use"),
    (["train", "--checkpoint-dir", "{tmp}/ck", "--save-every", "50", "--steps", "10"],
     "never saves"),
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
    (["train", "--budget", "lots"], "byte count"),
    (["train", "--save-every", "0"], "positive integer"),
    (["train", "--collective-timeout", "0"], "positive number"),
    (["train", "--collective-timeout", "soon"], "positive number"),
    (["bench", "--checkpoint-dir", "ck"], "unrecognized arguments"),
])
def test_argparse_level_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


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
                                                                           False, 16)
    assert cfg.engines == (Engine.ZBUF,)
    gpu = TrainConfig(global_batch=8).resolve(cuda=True, world=4, bench=True)
    assert (gpu.micro_batch, gpu.dtype, gpu.ac, gpu.steps, gpu.warmup) == (2, "bf16", True, 30, 10)
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
