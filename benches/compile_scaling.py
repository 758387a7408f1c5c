"""How the first step's compile phases grow with the number of identical blocks, on CPU (issue 21).

    python benches/compile_scaling.py --layers 2 8 16 --engines zbuf-whole zbuf-blocks fsdp2 \\
        --out benches/results/compile_scaling_cpu

Each (engine, layers) runs in a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR`` (a cold
launch) and, with ``--warm``, a second process on the same cache dir (a warm launch). One rank
(a 1-rank gloo group), the ``tiny`` preset's block shape, fp32, Inductor (or ``--inner
aot_eager``), one training step
(forward, backward, optimizer) timed by ``PhaseClock`` ([Note: compile phases]). Engines:

- ``zbuf-whole``: ``zbuf.compile(..., structure="graph")``: the whole model one frame;
- ``zbuf-blocks``: ``zbuf.compile(..., structure="blocks")``: one Dynamo frame per block, shared
  by identical blocks, the gathers in zbuf's runtime ([Note: one Dynamo frame per block]);
- ``fsdp2``: torchtitan's structure: each block ``Module.compile``-d, then ``fully_shard``.

After the first step, ``STEADY_STEPS`` more steps are timed (``steady_step_s``: their median).

Besides the phases, the counts of torch's compile spans (how many times each stage ran: Dynamo
frames, AOT dispatcher creations, partitions, Inductor lowerings) and the outer graphs' node
counts, which say *what* grows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

STEADY_STEPS = 5
"""Steps timed after the first (the median is the row's step time)."""

_COUNTED = ("_compile.compile_inner", "create_aot_dispatcher_function", "aot_trace_joint_graph",
            "min_cut_rematerialization_partition", "compile_fx_inner", "GraphLowering.run",
            "GraphLowering.codegen", "zbuf.schedule_pass", "backward._backward_impl")


def _one(engine: str, layers: int, ac: bool, inner: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    import zbuf
    from torch._dynamo.utils import compilation_time_metrics
    from zbuf.models import apply_activation_checkpointing, build_model, loss, resolve_config
    from zbuf.train.compile_phases import PhaseClock

    cfg = resolve_config("tiny").replace(num_layers=layers)
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_activation_checkpointing(model, ac)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for block in model.layers:
            block.compile(backend=inner, fullgraph=True)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        step = lambda: loss(model, tokens, targets)  # noqa: E731
        params = model.parameters()
    elif engine == "zbuf-blocks":
        sharded = zbuf.shard(model)
        cm = zbuf.compile(sharded, inner=inner, fullgraph=True, structure="blocks",
                          budget_bytes=1 << 30)
        step = lambda: loss(cm, tokens, targets)  # noqa: E731
        params = sharded.parameters()
    else:
        sharded = zbuf.shard(model)
        cm = zbuf.compile(sharded, inner=inner, fullgraph=True, structure="graph",
                          budget_bytes=1 << 30)
        step = lambda: loss(cm, tokens, targets)  # noqa: E731
        params = sharded.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = {k: len(compilation_time_metrics.get(k, [])) for k in _COUNTED}
    t0 = time.perf_counter()
    with PhaseClock() as clock:
        lo = step()
        lo.backward()
        opt.step()
        opt.zero_grad()
    wall = time.perf_counter() - t0
    res = clock.result(wall)
    steady = []
    for _ in range(STEADY_STEPS):
        t1 = time.perf_counter()
        lo2 = step()
        lo2.backward()
        opt.step()
        opt.zero_grad()
        steady.append(time.perf_counter() - t1)
    spans = {k: len(compilation_time_metrics.get(k, [])) - before[k] for k in _COUNTED}
    span_s = {k: round(sum(compilation_time_metrics.get(k, [])[before[k]:]), 3) for k in _COUNTED}
    out = {"engine": engine, "layers": layers, "ac": ac,
           "inner": inner, "first_step_s": round(wall, 3),
           "steady_step_s": round(sorted(steady)[len(steady) // 2], 4),
           "phases": {k: round(v, 3) for k, v in res.phases.items()},
           "zbuf_passes": {k: round(v, 3) for k, v in res.zbuf_passes.items()},
           "kernel_compile_work_s": round(res.kernel_compile_work_s, 3), "cpu_s": round(res.cpu_s, 3),
           "caches": res.caches, "spans": spans, "span_s": span_s, "loss": lo.item()}
    if engine == "zbuf-blocks":
        from zbuf.compile.block_frames import block_frames_of

        out["frame_graphs"] = block_frames_of(sharded).graphs_compiled
    elif engine != "fsdp2":
        from zbuf.compile import schedule_report

        out["outer_graph_gathers"] = [r.gathers for r in schedule_report(sharded) or []]
    return out


def markdown(rows: list[dict]) -> str:
    """One table row per launch: phases (wall s), CPU s, and how many times each stage ran."""
    head = ("| engine | layers | launch | first step | CPU s | dynamo | aot | zbuf | inductor "
            "| kernels | first run | Dynamo frames | lowerings "
            "| FX hit/miss | AOT hit/miss | step (ms) |")
    lines = [head, "|" + " --- |" * 3 + " ---: |" * 13]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['layers']} | {r['launch']} | failed |" + " |" * 12)
            continue
        ph, sp, c = r["phases"], r["spans"], r["caches"]
        lines.append(
            f"| {r['engine']} | {r['layers']} | {r['launch']} | {r['first_step_s']:.1f} "
            f"| {r['cpu_s']:.1f} | " + " | ".join(f"{ph[k]:.1f}" for k in (
                "dynamo", "aot", "zbuf", "inductor", "kernel_compile", "first_run"))
            + f" | {sp['_compile.compile_inner']} "
            f"| {sp['GraphLowering.run']} | {c['fxgraph_hit']}/{c['fxgraph_miss']} "
            f"| {c['aot_hit']}/{c['aot_miss']} | {1e3 * r.get('steady_step_s', float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--engines", nargs="+", default=["zbuf-whole", "zbuf-blocks", "fsdp2"])
    p.add_argument("--ac", action="store_true", help="checkpoint every block")
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                   help="the compiler (aot_eager: Dynamo and AOTAutograd only, no codegen)")
    p.add_argument("--warm", action="store_true", help="also a second launch on the same caches")
    p.add_argument("--kernels-dir", metavar="ROOT",
                   help="one kernel cache per engine under ROOT, prewarmed by a first 2-layer run "
                        "where missing, with the FX-graph and AOTAutograd caches off: every "
                        "launch compiles its graphs but finds its C++ kernels built (the 2-core "
                        "box's C++ compile would otherwise hide the phases that scale)")
    p.add_argument("--out", help="output path without extension (.json, .md)")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a result file")
    p.add_argument("--one", nargs=2, metavar=("ENGINE", "LAYERS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(_one(args.one[0], int(args.one[1]), args.ac, args.inner)), flush=True)
        return 0
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)["rows"]), end="")
        return 0
    rows = []
    root = args.kernels_dir
    shared = {e: os.path.join(root, e) for e in args.engines} if root else {}
    plan = [(l, e) for l in args.layers for e in args.engines]
    plan = [(-2, e) for e in args.engines if root and not os.path.isdir(shared[e])] + plan
    for layers, engine in plan:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
                if root:
                    env.update(TORCHINDUCTOR_CACHE_DIR=shared[engine], TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                               TORCHINDUCTOR_AUTOGRAD_CACHE="0")
                prewarm = layers < 0
                layers = abs(layers)
                for launch in ("cold", "warm") if args.warm else ("cold",):
                    cmd = [sys.executable, __file__, "--one", engine, str(layers)]
                    cmd += (["--ac"] if args.ac else []) + ["--inner", args.inner]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if out.returncode != 0:
                        print(out.stderr[-3000:], file=sys.stderr)
                        row = {"engine": engine, "layers": layers, "error": out.stderr[-500:]}
                    else:
                        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
                        row = json.loads(line[len("RESULT "):])
                    row["launch"] = "prewarm" if prewarm else launch
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.out:
        import torch

        meta = {"torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load": os.getloadavg(), "ac": args.ac,
                "inner": args.inner}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
