"""Which parts of blocks-compiled-once's first step grow with the number of layers, on CPU (issue 21).

    python benches/compile_growth.py --layers 2 8 16 --inner aot_eager inductor \\
        --kernels-dir /tmp/zbuf-kernels --out benches/results/compile_growth_cpu

Each (inner, layers) runs in a fresh process: one rank (a 1-rank gloo group), the ``tiny``
preset's block shape, micro-batch 2 x seq 32, fp32, ``zbuf.compile`` with its default
``compile_blocks_once=True``. The process first compiles and steps a 2-layer model, then, after
``torch._dynamo.reset()``, the measured model: torch's lazy imports and one-off set-up (about
1 s, more under Inductor) fall on the first compile, so the second shows the work that depends
on the model. With ``--kernels-dir`` Inductor's FX-graph and AOTAutograd caches are off and the
C++ kernels are found on disk (the 2-core box would otherwise spend minutes compiling them).

Besides the phases of [Note: compile phases] (zbuf/train/compile_phases.py), CPU seconds of the
parts that grow, each from a wrapper on one torch function:

- Dynamo's speculation of a block body (``InvokeSubgraphHigherOrderVariable.create_wrapped_node``:
  Dynamo traces every call of the nested region to compare it with the installed body) and its
  guard building (``CheckFunctionManager``); what is left of the ``dynamo`` phase is the outer
  frame's own tracing (the loop, each block's gathers);
- Inductor's lowering of the graphs (``GraphLowering.run``), of it the zbuf ops lowered as
  fallback kernels (``FallbackKernel.create``, count and seconds), and the fake-tensor
  re-propagation after the post-grad passes (``FakeTensorUpdater.incremental_update``: the
  nodes zbuf's schedule pass added).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_PARTS = ("speculate", "guards", "lowering", "fallback", "fake_reprop")


def _timed(owner, name: str, part: str, acc, counts, classmethod_=False) -> None:
    fn = owner.__dict__[name].__func__ if classmethod_ else getattr(owner, name)

    def wrapper(*a, **k):
        t = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            acc[part] += time.process_time() - t
            counts[part] += 1

    setattr(owner, name, classmethod(wrapper) if classmethod_ else wrapper)


def _one(layers: int, inner: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    import torch._dynamo.guards as guards
    import torch._dynamo.variables.higher_order_ops as hops
    import torch._inductor.fx_utils as fx_utils
    import torch._inductor.graph as inductor_graph
    import torch._inductor.ir as ir

    import zbuf
    from zbuf.models import build_model, loss, resolve_config
    from zbuf.train.compile_phases import PhaseClock

    acc, counts = collections.Counter(), collections.Counter()
    _timed(hops.InvokeSubgraphHigherOrderVariable, "create_wrapped_node", "speculate", acc, counts)
    _timed(guards.CheckFunctionManager, "__init__", "guards", acc, counts)
    _timed(inductor_graph.GraphLowering, "run", "lowering", acc, counts)
    _timed(ir.FallbackKernel, "create", "fallback", acc, counts, classmethod_=True)
    _timed(fx_utils.FakeTensorUpdater, "incremental_update", "fake_reprop", acc, counts)

    def step(n: int):
        torch._dynamo.reset()
        cfg = resolve_config("tiny").replace(num_layers=n)
        torch.manual_seed(0)
        sharded = zbuf.shard(build_model(cfg))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        cm = zbuf.compile(sharded, inner=inner, fullgraph=True, budget_bytes=1 << 30)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        acc.clear()
        counts.clear()
        t0 = time.perf_counter()
        with PhaseClock() as clock:
            lo = loss(cm, tokens, targets)
            lo.backward()
            opt.step()
        return clock.result(time.perf_counter() - t0), lo.item()

    step(2)
    res, lo = step(layers)
    return {"layers": layers, "inner": inner, "first_step_s": round(res.first_step_s, 3),
            "cpu_s": round(res.cpu_s, 3), "phases": {k: round(v, 3) for k, v in res.phases.items()},
            "parts_s": {k: round(acc[k], 3) for k in _PARTS},
            "parts_n": {k: counts[k] for k in _PARTS}, "loss": lo}


def markdown(rows: list[dict]) -> str:
    head = ("| inner | layers | CPU s | dynamo | - body speculation | - guards | - rest | aot "
            "| zbuf | inductor | - lowering | - fallback kernels (n) | - fake re-prop "
            "| kernels | first run |")
    lines = [head, "| --- |" + " ---: |" * 14]
    for r in rows:
        ph, p, n = r["phases"], r["parts_s"], r["parts_n"]
        rest = ph["dynamo"] - p["speculate"] - p["guards"]
        lines.append(
            f"| {r['inner']} | {r['layers']} | {r['cpu_s']:.2f} | {ph['dynamo']:.2f} "
            f"| {p['speculate']:.2f} | {p['guards']:.2f} | {rest:.2f} | {ph['aot']:.2f} "
            f"| {ph['zbuf']:.2f} | {ph['inductor']:.2f} | {p['lowering']:.2f} "
            f"| {p['fallback']:.2f} ({n['fallback']}) | {p['fake_reprop']:.2f} "
            f"| {ph['kernel_compile']:.2f} | {ph['first_run']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"],
                   choices=("aot_eager", "inductor"))
    p.add_argument("--kernels-dir", metavar="DIR",
                   help="Inductor's cache dir, kept across launches, with the FX-graph and "
                        "AOTAutograd caches off (only the C++ kernels are found there)")
    p.add_argument("--out", help="output path without extension (.json, .md)")
    p.add_argument("--one", nargs=2, metavar=("LAYERS", "INNER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(_one(int(args.one[0]), args.one[1])), flush=True)
        return 0
    rows = []
    for inner in args.inner:
        for layers in args.layers:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
                if args.kernels_dir:
                    env.update(TORCHINDUCTOR_CACHE_DIR=args.kernels_dir,
                               TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
                out = subprocess.run([sys.executable, __file__, "--one", str(layers), inner],
                                     env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
            rows.append(json.loads(line[len("RESULT "):]))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        import torch

        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load": os.getloadavg()}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(rows))
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
