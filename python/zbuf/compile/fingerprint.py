"""Collective-order fingerprints and their cross-rank check.

[Note: collective order check]
Every rank must issue the same collectives in the same order, or NCCL/gloo hangs or, worse,
pairs the wrong buffers. The plan is rank-invariant by construction ([Note: rank-invariant
schedule]), but user code can still hand ranks different graphs (rank-dependent control flow,
different shapes, a recompile on one rank). So each compiled graph carries a description of
itself (the shapes of its inputs and its collectives in issue order) and the description's hash;
on *every* run ``zbuf::check_schedule`` all-gathers the hash (8 bytes) and, only on a mismatch,
the descriptions, then raises ``ScheduleMismatchError`` on every rank naming the first
difference: an input shape, or a collective.

Every run, not only a graph's first: a rank whose inputs hit a graph it already ran while its
peer's inputs compile a new graph would otherwise pair the peer's first-run check with its own
first gather, and hang or corrupt ([Note: variable sequence lengths]). The check is the first
collective of every graph, so whichever graphs the ranks run, their checks pair with each other.
It costs one 8-byte all-gather per graph run (two per training step); on NCCL also a host sync
at the top of each graph, i.e. the host stops running ahead of the device there. Under
``check_fingerprint=False`` no check runs (a mismatch then hangs).

[Note: variable sequence lengths]
What happens when the sequence length changes from step to step (measured on torch 2.11, the
tiny preset, aot_eager; ``tests/test_varlen.py``):

- By default Dynamo compiles the first length as static shapes; the first step with another
  length recompiles once with that dimension dynamic (automatic dynamic shapes), and that graph
  serves every later length: two graphs (a forward and a backward each), planned by zbuf when
  they compile. A length of 0 or 1, or model code that branches on the length, can add more
  (``torch._dynamo.config.recompile_limit`` bounds them).
- ``torch._dynamo.mark_dynamic(tokens, 1, max=L)`` on every batch (the targets too) makes the
  first graph dynamic: one graph in all.
- The plan must hold for the longest input a graph accepts, so the planner counts a symbolic size
  at its upper bound when it has one, else at the size the graph was compiled at
  (``graph_info._hint``). Bounds come from ``mark_dynamic(..., max=L)`` or from the model's own
  checks: ``zbuf.models`` decoders check the length against ``max_seq_len``, so their automatic
  dynamic graph is planned for ``max_seq_len`` (2048 on ``tiny``: an activation estimate 7x the
  one at 256 tokens). Unbounded, a longer input than the compiled one runs with more activation
  memory than the budget was planned with: bound the dimension where memory is tight.
- Ranks that see different lengths in the same step run different graphs unless the dimension is
  dynamic in the graph every rank runs (marked from the first step, and no rank compiled another
  graph since). The input shapes are part of each graph's description, so the check above stops
  every rank with ``ScheduleMismatchError`` naming the shapes, instead of hanging.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
import torch.fx

from .. import runtime
from ..devices import current_cuda

__all__ = [
    "ScheduleMismatchError",
    "collective_order",
    "collective_nodes",
    "input_shapes",
    "describe_graph",
    "fingerprint_of",
    "check_across_ranks",
]


class ScheduleMismatchError(RuntimeError):
    """Ranks compiled graphs whose collectives differ; continuing would hang or corrupt data."""


# Ops of the zbuf namespace that communicate (start carries the gather; wait/release do not).
# ``all_gather`` and ``reduce_scatter`` are the functional forms autograd traces; the pass replaces
# them, and check_token_chain (rewrite.py) refuses a graph in which one is left.
_COLLECTIVE_OPS = ("all_gather_start", "reduce_scatter_start", "all_gather", "reduce_scatter")

def _describe(node: torch.fx.Node) -> str | None:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, name = target.namespace, target._schema.name.split("::")[-1]
    if ns == "zbuf" and name in _COLLECTIVE_OPS:
        pass
    elif ns == "_c10d_functional" and not name.startswith("wait"):
        pass
    else:
        return None

    def plain(a):
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
            return "?"
        if isinstance(a, (list, tuple)):
            return [plain(x) for x in a]
        if isinstance(a, torch.dtype):
            return str(a).removeprefix("torch.")
        return a

    # The token is an implementation detail; everything else identifies the collective.
    args = [plain(a) for a in node.args if not (isinstance(a, torch.fx.Node) and a.name.startswith("zbuf_token"))]
    if name == "all_gather_start":
        # Name the parameters: the buffers' producers carry their ids.
        args.append([b.args[2] if isinstance(b, torch.fx.Node) else "?" for b in node.args[1]])
    return f"{ns}::{name}{json.dumps(args, default=str, separators=(',', ':'))}"


def collective_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's communicating nodes, in graph order."""
    return [n for n in graph.nodes if _describe(n) is not None]


def collective_order(graph: torch.fx.Graph) -> list[str]:
    """The graph's collectives in execution order, as rank-comparable strings."""
    return [d for n in graph.nodes if (d := _describe(n)) is not None]


def input_shapes(graph: torch.fx.Graph) -> list[str]:
    """The graph's tensor inputs as rank-comparable strings (``int64[1, 256]``; a dynamic size
    shows as its symbol, ``int64[1, s27]``). Scalar inputs (symbolic sizes, strides and storage
    offsets that Dynamo passes) are left out: ranks may legitimately differ in them, e.g. a rank
    whose batch is a slice at a nonzero offset gets a symbolic offset where rank 0 has none, and
    run the same collectives."""
    out = []
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            out.append(f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}")
    return out


def describe_graph(graph: torch.fx.Graph, order: list[str]) -> str:
    """What the ranks compare ([Note: collective order check]): input shapes and collectives."""
    return json.dumps({"inputs": input_shapes(graph), "collectives": order}, separators=(",", ":"))


def fingerprint_of(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()[:16]


def _device_for(pg: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(pg) == "nccl":
        return current_cuda()
    return torch.device("cpu")


def check_across_ranks(group_name: str, fingerprint: str, description: str) -> None:
    """See [Note: collective order check]. ``description``: ``describe_graph``'s JSON."""
    pg = runtime.process_group(group_name)
    world = pg.size()
    if world == 1:
        return
    mine = torch.tensor([int(fingerprint[:15], 16)], dtype=torch.int64, device=_device_for(pg))
    all_fp = torch.empty(world, dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(all_fp, mine, group=pg)
    if len(set(all_fp.tolist())) != 1:
        descriptions: list = [None] * world
        dist.all_gather_object(descriptions, description, group=pg)
        raise ScheduleMismatchError(_first_difference(descriptions, dist.get_rank(pg)))


def _first_mismatch(mine: list, theirs: list, missing: str) -> tuple[int, str, str]:
    """Index of the first entry where two lists differ, and both entries there (``missing``
    where a list has ended)."""
    i = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b),
             min(len(mine), len(theirs)))
    return (i, mine[i] if i < len(mine) else missing, theirs[i] if i < len(theirs) else missing)


def _first_difference(descriptions: list[str], me: int) -> str:
    graphs = [json.loads(x) for x in descriptions]
    ref = graphs[me]
    for other, graph in enumerate(graphs):
        if graph == ref:
            continue
        if ref["inputs"] != graph["inputs"]:
            i, a, b = _first_mismatch(ref["inputs"], graph["inputs"], "<no such input>")
            return (
                f"ranks ran graphs compiled for different input shapes: input #{i} is {a} on "
                f"rank {me} but {b} on rank {other}. Every rank must feed the same shapes in the "
                "same step (the same sequence length), or mark the varying dimension dynamic on "
                "every batch from the first step, e.g. torch._dynamo.mark_dynamic(tokens, 1, "
                "max=longest), so that one graph serves every length."
            )
        if ref.get("kept", []) != graph.get("kept", []):
            return (
                f"ranks keep different gathered weights for backward: rank {me} keeps parameters "
                f"{ref.get('kept', [])}, rank {other} keeps {graph.get('kept', [])}, so their "
                "backward graphs would skip different gathers. The keep-set must be chosen from "
                "rank-agreed inputs at the same point of every rank ([Note: weights kept at run "
                "time] in zbuf/kept_weights.py); this is a zbuf bug unless a rank changed it by "
                "hand."
            )
        ref_c, order = ref["collectives"], graph["collectives"]
        i, a, b = _first_mismatch(ref_c, order, "<end of graph>")
        return (
            f"ranks compiled graphs with different collective orders: collective #{i} is {a} on "
            f"rank {me} but {b} on rank {other} ({len(ref_c)} vs {len(order)} collectives). Every "
            "rank must run the same model code on the same input shapes; look for rank-dependent "
            "control flow or data-dependent shapes."
        )
    return "ranks disagree on the schedule fingerprint although their graph descriptions are equal"
