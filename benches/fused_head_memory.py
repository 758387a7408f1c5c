"""The output head and the loss alone, fused or not: projected activation peaks, on CPU with meta
tensors, for [Note: fused output head] in python/zbuf/models.py.

qwen3-1.7b's head by default (vocabulary 151,936, hidden 2,048, bf16), micro-batch 4 x seq 4,096
= 16,384 tokens. Each variant is compiled (AOTAutograd, the min-cut partitioner zbuf's backend
runs) on meta tensors, so nothing is allocated and every shape is real; the forward and backward
graphs are measured with ``zbuf.compile.graph_info.activation_profile``, the static liveness zbuf's
planner budgets with (inputs counted: ``h`` and ``W`` in forward, what forward saved in backward).

    python benches/fused_head_memory.py [--tokens 16384] [--hidden 2048] [--vocab 151936]

Variants: ``unfused``, ``cross_entropy(F.linear(h, W), targets)`` as the engines computed it
before (the bf16 logits, then [Note: lean cross-entropy]); ``fused``,
``linear_cross_entropy(h, W, targets)``. Columns: bytes forward saves for backward, the forward
and backward graphs' peaks, the largest single tensor either makes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

GiB = float(1 << 30)


def measure(fn, tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> dict:
    from zbuf.compile.graph_info import activation_profile

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.graph
            return make_boxed_func(gm)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    h = torch.empty(tokens, hidden, dtype=dtype, device="meta", requires_grad=True)
    weight = torch.empty(vocab, hidden, dtype=dtype, device="meta", requires_grad=True)
    targets = torch.empty(tokens, dtype=torch.long, device="meta")
    torch.compile(fn, backend=backend, fullgraph=True)(h, weight, targets).backward()

    def nbytes(node):
        val = node.meta.get("val")
        return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0

    saved = sum(nbytes(n) for n in graphs["backward"].nodes
                if n.op == "placeholder" and not n.name.startswith("tangents"))
    largest = max(nbytes(n) for g in graphs.values() for n in g.nodes)
    return {"saved": saved / GiB,
            "forward peak": int(activation_profile(graphs["forward"]).max()) / GiB,
            "backward peak": int(activation_profile(graphs["backward"]).max()) / GiB,
            "largest tensor": largest / GiB}


def main() -> None:
    from zbuf import models

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4 * 4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    variants = {
        "unfused": lambda h, w, t: models.cross_entropy(F.linear(h, w), t),
        "fused": models.linear_cross_entropy,
    }
    print(f"head [{args.vocab}, {args.hidden}] bf16, {args.tokens} tokens; GiB")
    rows = {name: measure(fn, args.tokens, args.hidden, args.vocab, torch.bfloat16)
            for name, fn in variants.items()}
    columns = list(next(iter(rows.values())))
    print(f"{'':10}" + "".join(f"{c:>16}" for c in columns))
    for name, row in rows.items():
        print(f"{name:10}" + "".join(f"{row[c]:16.2f}" for c in columns))


if __name__ == "__main__":
    main()
