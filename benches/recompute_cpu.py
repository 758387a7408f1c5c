"""Per-region recompute (zbuf's ``recompute="auto"``) against the min-cut partitioner's own
memory budget (a knapsack per op), on CPU, with fake tensors: bytes kept, activation peaks and
FLOPs recomputed, for [Note: per-region recompute] in python/zbuf/compile/recompute.py.

qwen3-8b's layer shape (``--layers`` of them), micro-batch 4, seq 4096, 2 ranks (a fake process
group): nothing is allocated and nothing runs; every shape is real. Attention is traced as a
flash-attention-shaped op (output and log-sum-exp saved, no seq x seq matrix), as on the GPU: on
the meta device ``F.scaled_dot_product_attention`` would trace the math kernel instead.

    python benches/recompute_cpu.py --layers 4 --out benches/results

Rows: zbuf's modes ("checkpointed": every block recomputed; "none": nothing; "auto" under
activation budgets spread between the two peaks), torch's knapsack at ``activation_memory_budget``
fractions (its "dp" solver), and the knapsack with a zbuf solver that works in bytes. Columns: the
budget asked for, bytes saved for backward, the activation peak of the forward and backward
graphs (static liveness, what the budget bounds), whether that peak stayed within a byte budget,
matmul/attention TFLOPs recomputed, partition seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

GIB = float(1 << 30)


def _flash_attention_op():
    """A stand-in for the GPU's flash attention: output and fp32 log-sum-exp, backward from
    q, k, v, output and log-sum-exp (its name tells zbuf's cost model it is attention)."""

    @torch.library.custom_op("zbuf_bench::scaled_dot_product_fa", mutates_args=())
    def fa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("shape-only stand-in")

    @fa.register_fake
    def _(q, k, v):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.custom_op("zbuf_bench::scaled_dot_product_fa_backward", mutates_args=())
    def fa_bw(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("shape-only stand-in")

    @fa_bw.register_fake
    def _(g, q, k, v, o, lse):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, go, _glse):
        return fa_bw(go, *ctx.saved_tensors)

    fa.register_autograd(backward, setup_context=setup)
    # The knapsack's "flops" runtime estimator must see attention's FLOPs, as it does for the
    # GPU's kernel.
    from torch.utils.flop_counter import (register_flop_formula, sdpa_backward_flop_count,
                                          sdpa_flop_count)

    register_flop_formula(torch.ops.zbuf_bench.scaled_dot_product_fa)(
        lambda q, k, v, *args, out_shape=None, **kw: sdpa_flop_count(q, k, v))
    register_flop_formula(torch.ops.zbuf_bench.scaled_dot_product_fa_backward)(
        lambda g, q, k, v, *args, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v))
    return lambda q, k, v, is_causal=False, **_: fa(q, k, v)[0]


def capture(layers: int, seq: int, micro_batch: int, world: int):
    """The joint graph zbuf's partitioner receives, and what it needs to partition it again."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    import zbuf.models as zmodels
    import zbuf.shard as zshard
    from zbuf.compile import recompute
    from zbuf.compile.passes import ZbufPartitioner

    sdpa = _flash_attention_op()
    zmodels.F = type("F", (), {k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    zmodels.F.scaled_dot_product_attention = staticmethod(sdpa)
    zshard._check_group_device = lambda group, device: None  # meta shards: no pool, no collective

    class NoPool:
        def __getattr__(self, name):
            raise AssertionError(f"pool.{name} used while tracing on meta tensors")

    cfg = zmodels.resolve_config("qwen3-8b").replace(num_layers=layers)
    model = zmodels.apply_activation_checkpointing(
        zmodels.build_model(cfg, device="meta", dtype=torch.bfloat16))
    model = zshard.shard(model, device="meta", pool=NoPool())
    captured = {}
    real = ZbufPartitioner.__call__

    def grab(self, gm, joint_inputs, **kwargs):
        captured.update(gm=recompute.copy_joint(gm), inputs=joint_inputs,
                        kwargs=dict(kwargs, compiler="inductor"),
                        fake_mode=torch._guards.detect_fake_mode(joint_inputs))
        return real(self, gm, joint_inputs, **kwargs)

    ZbufPartitioner.__call__ = grab
    try:
        cm = torch.compile(model, backend="zbuf", fullgraph=True,
                           options={"inner": "aot_eager", "persist": False})
        tokens = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        zmodels.loss(cm, tokens, tokens).backward()
    finally:
        ZbufPartitioner.__call__ = real
    return captured


def _min_cut(joint):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return lambda gm: min_cut_rematerialization_partition(gm, joint["inputs"], **joint["kwargs"])


def zbuf_mode(joint, mode: str, budget=None) -> dict:
    from zbuf.compile import CompileOptions, recompute
    from zbuf.compile.persist import tag_for_regather

    opts = CompileOptions(inner="aot_eager", persist=False, recompute=mode,
                          **({"activation_budget_bytes": budget} if budget else {}))
    t0 = time.perf_counter()
    with torch._guards.tracing(torch._guards.TracingContext(joint["fake_mode"])):
        fw, bw, _, stats = recompute.partition(recompute.copy_joint(joint["gm"]),
                                               joint["kwargs"]["num_fwd_outputs"], opts,
                                               _min_cut(joint),
                                               lambda g, peak: tag_for_regather(g, opts, peak))
    return _row(f"zbuf {mode}", budget, fw, bw, stats, time.perf_counter() - t0)


def knapsack(joint, *, fraction=None, byte_budget=None) -> dict:
    """Regions untagged (nothing forced to recompute), then torch's memory-budget partition."""
    from torch._functorch.partitioners import _size_of, estimate_runtime
    from torch._inductor.custom_graph_pass import CustomKnapsackSolver

    from zbuf.compile import CompileOptions, recompute
    from zbuf.compile.persist import tag_for_regather

    class ByteSolver(CustomKnapsackSolver):
        """Keep the nodes with the most FLOPs per byte while their bytes fit ``byte_budget``."""

        def __call__(self, memory, joint_graph, max_memory, node_info, nodes):
            sizes = [_size_of(n) for n in nodes]
            with torch._functorch.config.patch(activation_memory_budget_runtime_estimator="flops"):
                runtimes = [estimate_runtime(n) for n in nodes]
            order = sorted(range(len(nodes)), key=lambda i: (-runtimes[i] / max(sizes[i], 1), i))
            saved, recomputed, used = [], [], 0
            for i in order:
                if used + sizes[i] <= byte_budget:
                    saved.append(i)
                    used += sizes[i]
                else:
                    recomputed.append(i)
            return saved, recomputed

        def uuid(self):
            return "zbuf-bench-byte-solver"

    opts = CompileOptions(inner="aot_eager", persist=False)
    gm = recompute.copy_joint(joint["gm"])
    nfw = joint["kwargs"]["num_fwd_outputs"]
    regions = recompute.find_regions(gm.graph, recompute.forward_nodes(gm.graph, nfw))
    recompute.apply_levels(gm.graph, regions, (2,) * len(regions))
    tag_for_regather(gm.graph, opts)
    patch = ({"activation_memory_budget": fraction} if fraction is not None else
             # a tiny fraction always reaches the solver; the solver works in bytes
             {"activation_memory_budget": 1e-6, "activation_memory_budget_solver": ByteSolver()})
    fwd = recompute.forward_names(joint["gm"].graph, nfw)
    t0 = time.perf_counter()
    with torch._guards.tracing(torch._guards.TracingContext(joint["fake_mode"])), \
            torch._functorch.config.patch(patch):
        fw, bw = _min_cut(joint)(gm)
    stats = recompute.measure_partition("knapsack", fwd, fw, bw, opts, regions=len(regions))
    name = f"knapsack dp {fraction:.2f}" if fraction is not None else "knapsack zbuf bytes"
    return _row(name, byte_budget, fw, bw, stats, time.perf_counter() - t0)


def _row(name, budget, fw, bw, stats, seconds) -> dict:
    from zbuf.compile.graph_info import activation_profile

    fw_peak = int(activation_profile(fw.graph).max())
    bw_peak = int(activation_profile(bw.graph).max())
    row = {"variant": name, "budget_bytes": budget, "kept_bytes": stats.kept_bytes,
           "fw_peak_bytes": fw_peak, "bw_peak_bytes": bw_peak,
           "recomputed_tflops": stats.recomputed_flops / 1e12,
           "forward_tflops": stats.forward_flops / 1e12, "seconds": seconds,
           "levels": [stats.regions_recomputed, stats.regions_selective, stats.regions_kept]}
    if budget is not None:
        row["within_budget"] = max(fw_peak, bw_peak) <= budget if name.startswith("zbuf") else (
            stats.kept_bytes <= budget)
    return row


def markdown(result: dict) -> str:
    a = result["args"]
    lines = ["## Recompute: per region (zbuf) vs the partitioner's knapsack, CPU, fake tensors",
             "",
             f"qwen3-8b layer shape, {a['layers']} layers, micro-batch {a['micro_batch']} x seq "
             f"{a['seq']}, {a['world']} ranks; torch {result['torch']}; "
             f"`python benches/recompute_cpu.py --layers {a['layers']}`.",
             "Budget: zbuf rows bound the activation peak (static liveness of the forward and "
             "backward graphs); the byte-solver row bounds the bytes its knapsack keeps; dp rows "
             "take a fraction. Levels: regions recomputed / selective / kept.", "",
             "| variant | budget | kept for backward | fw peak | bw peak | within budget | "
             "recomputed TFLOP | levels | partition s |",
             "| --- | ---: | ---: | ---: | ---: | :---: | ---: | :---: | ---: |"]
    for r in result["rows"]:
        b = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / GIB:.2f} GiB"
        w = {True: "yes", False: "**no**"}.get(r.get("within_budget"), "-")
        lv = "/".join(map(str, r["levels"])) if r["variant"].startswith("zbuf") else "-"
        lines.append(f"| {r['variant']} | {b} | {r['kept_bytes'] / GIB:.2f} GiB | "
                     f"{r['fw_peak_bytes'] / GIB:.2f} GiB | {r['bw_peak_bytes'] / GIB:.2f} GiB | {w} | "
                     f"{r['recomputed_tflops']:.2f} | {lv} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for recompute_cpu.{json,md}")
    args = p.parse_args()
    joint = capture(args.layers, args.seq, args.micro_batch, args.world)
    rows = [zbuf_mode(joint, "checkpointed"), zbuf_mode(joint, "none")]
    low = max(rows[0]["fw_peak_bytes"], rows[0]["bw_peak_bytes"])
    high = max(rows[1]["fw_peak_bytes"], rows[1]["bw_peak_bytes"])
    budgets = [low + (high - low) * k // 8 for k in range(1, 8)]
    rows += [zbuf_mode(joint, "auto", b) for b in budgets]
    rows += [knapsack(joint, fraction=f) for f in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)]
    kept_low, kept_high = rows[0]["kept_bytes"], rows[1]["kept_bytes"]
    rows += [knapsack(joint, byte_budget=kept_low + (kept_high - kept_low) * k // 8)
             for k in range(1, 8)]
    result = {"args": vars(args), "torch": torch.__version__, "host": platform.node(),
              "rows": rows}
    text = markdown(result)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "recompute_cpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "recompute_cpu.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
