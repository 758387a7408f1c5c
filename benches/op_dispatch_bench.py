"""Host cost of the ops the compile pass puts in graphs, as registered against ``custom_op``.

A compiled zbuf graph calls, per gathered parameter and step, ``zbuf::gather_buffer``,
``all_gather_start``, ``all_gather_wait`` and ``all_gather_release`` (forward, and again in
backward for re-gathered parameters), and per gradient ``reduce_scatter_start`` and
``reduce_scatter_wait``. Inductor's wrapper calls each as ``torch.ops.zbuf.<name>.default``: a
C++ dispatch into the op's Python kernel. This measures, per sequence and per op, the host time
of three registrations of the very same Python kernels, side by side in one run:
  * ``zbuf``:      the ops as zbuf registers them (``torch.library.Library``, one
    ``CompositeExplicitAutograd`` kernel: [Note: lean dispatch] in compile/collectives.py);
  * ``custom_op``: the same kernels registered with ``torch.library.custom_op`` (what zbuf did
    before; Python autograd, ADInplaceOrView and ``torch._dynamo.disable`` layers per call);
  * ``bodies``:    the kernels called as plain Python functions (no dispatcher: the floor).
On one rank (gloo, or NCCL on CUDA): the start's collective is a copy there, so this is host
dispatch cost, not communication. Variants run interleaved; minimum over repeats reported.

Usage: python benches/op_dispatch_bench.py [--device cpu|cuda|all] [--out benches/results]
Writes op_dispatch_<device>.json and op_dispatch_<device>.md.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pool_bench import cpu_model, git_commit, interleaved_ns, parse_bench_args, warm_up  # noqa: E402

from zbuf import runtime  # noqa: E402
from zbuf.compile import collectives as C  # noqa: E402
from zbuf.pool import default_pool  # noqa: E402

PARAM_ID = 77_001
NUMEL = 1 << 16  # one 256 KiB fp32 shard: small, so copies do not hide dispatch


def _custom_op_copies() -> dict:
    """The kernels of ``collectives`` registered with ``torch.library.custom_op``."""
    mutates = {
        "gather_buffer": ("token",),
        "all_gather_start": ("token", "gathered"),
        "all_gather_wait": ("token", "gathered"),
        "all_gather_release": ("token", "released"),
        "reduce_scatter_start": ("token",),
        "reduce_scatter_wait": ("token", "started"),
    }
    for name, args in mutates.items():
        torch.library.custom_op(f"zbuf_bench::{name}", mutates_args=args)(getattr(C, name))
    return {name: getattr(torch.ops.zbuf_bench, name).default for name in mutates}


def _sequences(ops: dict, token, shard, group: str, grad, pool_id: int) -> dict:
    def gather():
        b = ops["gather_buffer"](token, shard, PARAM_ID, [NUMEL], group, None, pool_id)
        ops["all_gather_start"](token, [b], [shard], group)
        ops["all_gather_wait"](token, [b])
        ops["all_gather_release"](token, [b], [pool_id], [b])

    def buffer_release():
        b = ops["gather_buffer"](token, shard, PARAM_ID, [NUMEL], group, None, pool_id)
        ops["all_gather_release"](token, [b], [pool_id], [b])

    def reduce_scatter():
        started = ops["reduce_scatter_start"](token, grad, PARAM_ID, NUMEL, group, None)
        ops["reduce_scatter_wait"](token, started)

    return {"gather cycle (buffer, start, wait, release)": gather,
            "buffer + release": buffer_release,
            "reduce-scatter (start, wait)": reduce_scatter}


def bench_device(device: str, iters: int, repeats: int) -> dict:
    dev = torch.device(device)
    token = torch.zeros(1, device=dev)
    shard = torch.randn(NUMEL, device=dev)
    grad = torch.randn(NUMEL, device=dev)
    group = dist.group.WORLD.group_name
    variants = {
        "zbuf": {n: getattr(torch.ops.zbuf, n).default for n in _KERNELS},
        "custom_op": _CUSTOM,
        "bodies": {n: getattr(C, n) for n in _KERNELS},
    }
    # A sharded parameter's pool, as compiled graphs name it ([Note: pool ids] in runtime.py).
    pool_id = runtime.pool_id_of(default_pool(dev))
    # ...and its root's op counts ([Note: counts live with their model]): PARAM_ID belongs to no
    # model, so without this the ops would skip the counting a real parameter's ops do.
    counts = collections.Counter()
    runtime.count_into([PARAM_ID], counts)
    seqs = {v: _sequences(ops, token, shard, group, grad, pool_id) for v, ops in variants.items()}
    warm_up(1.0, seqs["zbuf"]["gather cycle (buffer, start, wait, release)"])
    floor = torch.zeros(1, device=dev)
    aten_ns = interleaved_ns({"add_": lambda: floor.add_(1)}, iters, repeats)["add_"][0]
    rows = []
    for name in seqs["zbuf"]:
        got = interleaved_ns({v: seqs[v][name] for v in variants}, iters, repeats)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"sequence": name, **{f"{v}_ns": got[v][0] for v in variants},
                     **{f"{v}_median_ns": got[v][1] for v in variants}})
    assert C.pending(token) == 0, "a start was not waited for"
    assert counts["all_gather"] > 0 and counts["reduce_scatter"] > 0
    return {"device": device, "rows": rows, "aten_add_ns": aten_ns}


_KERNELS = ("gather_buffer", "all_gather_start", "all_gather_wait", "all_gather_release",
            "reduce_scatter_start", "reduce_scatter_wait")
_CUSTOM: dict = {}


def to_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# Compile-path op dispatch: {result['device']} ({env['cpu']})",
        "",
        f"torch {env['torch']}, Python {env['python']}, {env['cpu']} x{env['cpus']}, load avg "
        f"{env['load_avg']:.1f}, zbuf {env['zbuf']}, {env['time']}.",
        f"Host time per sequence, microseconds (minimum over {result['repeats']} interleaved runs "
        f"of {result['iters']} calls; medians in the JSON), one rank. `zbuf`: the ops as "
        f"registered ([Note: lean dispatch]); `custom_op`: the same kernels through "
        f"`torch.library.custom_op`; `bodies`: the kernels as plain Python calls. "
        f"Floor for comparison: `aten.add_` on one element, {result['aten_add_ns'] / 1e3:.2f} us.",
        "",
        "| sequence | zbuf | custom_op | bodies | zbuf / custom_op | dispatch saved per op call |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        calls = 4 if r["sequence"].startswith("gather cycle") else 2
        saved = (r["custom_op_ns"] - r["zbuf_ns"]) / calls / 1e3
        lines.append(
            f"| {r['sequence']} | {r['zbuf_ns'] / 1e3:.1f} | {r['custom_op_ns'] / 1e3:.1f} | "
            f"{r['bodies_ns'] / 1e3:.1f} | {r['zbuf_ns'] / r['custom_op_ns']:.2f} | "
            f"{saved:.1f} us |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args, devices = parse_bench_args(__doc__, iters=500, repeats=30)
    _CUSTOM.update(_custom_op_copies())
    os.makedirs(args.out, exist_ok=True)
    for device in devices:
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            result = bench_device(device, args.iters, args.repeats)
        finally:
            dist.destroy_process_group()
        result.update(iters=args.iters, repeats=args.repeats, environment={
            "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "zbuf": git_commit(),
            "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None})
        base = Path(args.out) / f"op_dispatch_{device}"
        base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        md = to_markdown(result)
        base.with_suffix(".md").write_text(md)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
