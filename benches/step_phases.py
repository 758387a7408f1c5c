"""Split one profiled training step into forward, loss and backward by GPU time.

Reads a torch.profiler trace (``*.trace.json.gz`` under a ``--profile-dir``) and takes the step
between the first two ``Optimizer.step`` ranges. The loss is the span of the softmax kernels
(a cross-entropy's log-softmax forward and backward), so this fits any model whose loss is a
softmax over logits; forward is what runs before it and backward (its recompute included) what
runs after. Matmul and attention kernels (``kernel_family`` "gemm" and "attention", as the
profile summaries of ``zbuf bench --profile-dir`` count them) are summed apart: they are the work
a recompute plan can add or remove.

    python3 benches/step_phases.py benches/results/.../profile/*.trace.json.gz
"""
import argparse
import gzip
import json

from zbuf.train.profile import DEVICE_CATEGORIES, kernel_family


def is_matmul(event) -> bool:
    return kernel_family(event["name"]) in ("gemm", "attention")


def phases(trace_path: str) -> dict:
    with gzip.open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    steps = sorted((e for e in events if e.get("cat") == "gpu_user_annotation"
                    and "Optimizer.step" in e["name"]), key=lambda e: e["ts"])
    if len(steps) < 2:
        raise SystemExit(f"{trace_path}: needs two profiled optimizer steps, found {len(steps)}")
    start, end = steps[0]["ts"] + steps[0]["dur"], steps[1]["ts"]
    step = [e for e in kernels if start <= e["ts"] < end]
    softmax = [e for e in step if "softmax" in e["name"].lower()]
    if not softmax:
        raise SystemExit(f"{trace_path}: no softmax kernel in the step; is the loss a cross-entropy?")
    loss_start, loss_end = softmax[0]["ts"], softmax[-1]["ts"] + softmax[-1]["dur"]
    parts = {"forward": [e for e in step if e["ts"] < loss_start],
             "loss": [e for e in step if loss_start <= e["ts"] <= loss_end],
             "backward": [e for e in step if e["ts"] > loss_end]}
    out = {}
    for name, part in parts.items():
        out[name] = {
            "wall_ms": (part[-1]["ts"] + part[-1]["dur"] - part[0]["ts"]) / 1000 if part else 0.0,
            "busy_ms": sum(e["dur"] for e in part) / 1000,
            "matmul_ms": sum(e["dur"] for e in part if is_matmul(e)) / 1000,
            "kernels": len(part),
        }
    out["optimizer_ms"] = steps[1]["dur"] / 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    for path in parser.parse_args().traces:
        print(path)
        for name, value in phases(path).items():
            print(f"  {name}: {value}")


if __name__ == "__main__":
    main()
