"""The output head and the loss, fused or not: projected activation peaks, on CPU with meta
tensors, for [Note: fused output head] in python/zbuf/models.py.

qwen3-1.7b's shape (vocabulary 151,936, hidden 2,048, bf16), micro-batch 4 x seq 4,096 = 16,384
tokens. Nothing is allocated and every shape is real; graphs are measured with
``zbuf.compile.graph_info.activation_profile``, the static liveness zbuf's planner budgets with.

    python benches/fused_head_memory.py [--tokens 16384] [--hidden 2048] [--vocab 151936]
    python benches/fused_head_memory.py --model-layers 2

Variants: ``unfused``, ``cross_entropy(F.linear(h, W), targets)`` as the engines computed it
before (the bf16 logits, then [Note: lean cross-entropy]); ``fused``,
``linear_cross_entropy(h, W, targets)``, what ``Decoder(tokens, targets)`` runs.

The head alone (default): each variant compiled with AOTAutograd's min-cut partitioner (the one
zbuf's backend runs), ``h`` and ``W`` counted as forward's inputs. Columns: bytes forward saves
for backward, the forward and backward graphs' peaks, the largest single tensor either makes.

``--model-layers N``: the qwen3-1.7b decoder cut to N layers (every block checkpointed), sharded
over a fake 1-rank group and compiled whole, loss included, with ``backend="zbuf"``; the
activation peaks of its forward and backward graphs from ``zbuf.schedule_report``. Attention is
traced as a flash-attention-shaped op, as in benches/recompute_cpu.py.
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


def model_peaks(layers: int, tokens: int) -> dict:
    """Forward and backward activation peaks (GiB) of the zbuf-compiled qwen3-1.7b decoder cut
    to ``layers``, per variant."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zbuf.models as zmodels
    import zbuf.shard as zshard
    from recompute_cpu import _flash_attention_op
    from zbuf.compile import schedule_report

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    zmodels.F = type("F", (), {k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    zmodels.F.scaled_dot_product_attention = staticmethod(_flash_attention_op())
    zshard._check_group_device = lambda group, device: None  # meta shards: no pool, no collective

    class NoPool:
        def __getattr__(self, name):
            raise AssertionError(f"pool.{name} used while tracing on meta tensors")

    class Unfused(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens, targets):
            return zmodels.cross_entropy(self.model(tokens), targets)

    cfg = zmodels.resolve_config("qwen3-1.7b").replace(num_layers=layers)
    rows = {}
    for name in ("unfused", "fused"):
        torch._dynamo.reset()
        model = zmodels.apply_activation_checkpointing(
            zmodels.build_model(cfg, device="meta", dtype=torch.bfloat16))
        model = zshard.shard(model, device="meta", pool=NoPool())
        compiled = torch.compile(Unfused(model) if name == "unfused" else model, backend="zbuf",
                                 fullgraph=True, options={"inner": "aot_eager", "persist": False})
        batch = torch.zeros(4, tokens // 4, dtype=torch.long, device="meta")
        compiled(batch, batch).backward()
        rows[name] = {f"{r.kind} peak": r.activation_peak_bytes / GiB
                      for r in schedule_report(model)}
    return rows


def main() -> None:
    from zbuf import models

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4 * 4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--model-layers", type=int, default=None)
    args = parser.parse_args()
    if args.model_layers is not None:
        print(f"qwen3-1.7b, {args.model_layers} layers, {args.tokens} tokens, zbuf; GiB")
        _print(model_peaks(args.model_layers, args.tokens))
        return
    variants = {
        "unfused": lambda h, w, t: models.cross_entropy(F.linear(h, w), t),
        "fused": models.linear_cross_entropy,
    }
    print(f"head [{args.vocab}, {args.hidden}] bf16, {args.tokens} tokens; GiB")
    _print({name: measure(fn, args.tokens, args.hidden, args.vocab, torch.bfloat16)
            for name, fn in variants.items()})


def _print(rows: dict) -> None:
    columns = list(next(iter(rows.values())))
    print(f"{'':10}" + "".join(f"{c:>16}" for c in columns))
    for name, row in rows.items():
        print(f"{name:10}" + "".join(f"{row[c]:16.2f}" for c in columns))


if __name__ == "__main__":
    main()
