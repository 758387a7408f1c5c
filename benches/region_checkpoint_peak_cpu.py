"""Backward activation peak of blocks compiled once under a user's checkpoint against the model
compiled whole, projected and measured on CPU, for [Note: region bodies] step 0 in
python/zbuf/compile/region_graphs.py.

Six MLP blocks (64 -> 256 -> 64, residual), each called through ``torch.utils.checkpoint`` by the
model's own loop, tokens 8 x 128, one rank, aot_eager. For each of "whole" (blocks traced into the
outer graph) and "once" (``mark_repeated_blocks``):
- projected: ``schedule_report``'s activation peaks (static liveness of the partitioned graphs);
- measured: the CPU allocator's bytes made by one step after the compiling one, read from the
  profiler's memory events (it counts what is allocated while it runs), forward and backward in
  one session. ``freeing``: the compiled graphs run by ``torch.fx.Interpreter.boxed_run``, which
  takes the argument list over and drops every value, a saved tensor too, after its last use, as
  Inductor's generated code does; ``aot_eager``: aot_eager's own boxed call, which keeps its
  argument list, so every saved tensor lives to the end of backward.
Each measurement runs in its own process (the profiler's counters outlive a session).

    python benches/region_checkpoint_peak_cpu.py --out benches/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

BLOCKS = 6


class Mlp(nn.Module):
    """One block: 64 -> 256 -> 64, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class CheckpointedStack(nn.Module):
    """A plain user script's checkpointing: each block called through ``checkpoint`` (every
    ``every``-th block only, when set). tests/test_compile_regions.py asserts on this model."""

    def __init__(self, n: int, every: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.blocks = nn.ModuleList(Mlp() for _ in range(n))
        self.head = nn.Linear(64, 50, bias=False)
        self.every = every

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(tokens)
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i % self.every == 0 else b(x)
        return self.head(x)


def _freeing_boxed(f):
    gm = f.__self__

    def run(args):
        return torch.fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def measure(once: bool, freeing: bool) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import zbuf.compile
    from zbuf.compile import schedule_report
    from zbuf.shard import shard

    if freeing:  # what the zbuf backend's aot_eager path boxes its graphs with
        import torch._functorch.aot_autograd as aot_autograd
        aot_autograd.make_boxed_func = _freeing_boxed
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.set_num_threads(1)
    tokens = torch.randint(0, 50, (8, 128), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = shard(CheckpointedStack(BLOCKS))
    if once:
        zbuf.compile.mark_repeated_blocks(model)
    cm = torch.compile(model, backend="zbuf",
                       options=dict(inner="aot_eager", free_memory_bytes=1 << 30))
    cm(tokens).float().square().mean().backward()  # the compiling step
    fw, bw = schedule_report(model)
    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cm(tokens).float().square().mean()
        with record_function("backward"):
            loss.backward()
    return dict(once=once, freeing=freeing, loss=loss.item(),
                projected_forward=fw.activation_peak_bytes,
                projected_backward=bw.activation_peak_bytes,
                kept_bytes=fw.recompute.kept_bytes, **_peaks(prof))


def _peaks(prof) -> dict:
    """Forward and backward peaks of the allocator bytes made in the session, from the chrome
    trace's memory events (their "Total Allocated" counts allocations made while profiling)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    mark = next(e for e in trace if e.get("name") == "backward")
    mem = sorted((e for e in trace if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    made = [(e["ts"], e["args"]["Total Allocated"] - base) for e in mem]
    return dict(measured_forward=max(b for t, b in made if t < mark["ts"]),
                measured_backward=max(b for t, b in made if t >= mark["ts"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        once, freeing = (x == "1" for x in args.one.split(","))
        print(json.dumps(measure(once, freeing)))
        return
    rows = []
    for freeing in (True, False):
        for once in (False, True):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, __file__, "--one", f"{int(once)},{int(freeing)}"],
                                 env=env, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    lines = ["| run | compiled | loss | projected bw | measured bw | projected fw | measured fw "
             "| kept |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'freeing' if r['freeing'] else 'aot_eager'} | "
                     f"{'once' if r['once'] else 'whole'} | {r['loss']:.8f} | "
                     f"{r['projected_backward']:,} | {r['measured_backward']:,} | "
                     f"{r['projected_forward']:,} | {r['measured_forward']:,} | "
                     f"{r['kept_bytes']:,} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(os.path.join(args.out, "region_checkpoint_peak_cpu.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
