"""Collective-order fingerprints and their cross-rank check.

[Note: collective order check]
Every rank must issue the same collectives in the same order, or NCCL/gloo hangs or, worse,
pairs the wrong buffers. The plan is rank-invariant by construction ([Note: rank-invariant
schedule]), but user code can still hand ranks different graphs (rank-dependent control flow,
different shapes, a recompile on one rank). So each compiled graph carries the list of its
collectives in issue order and its hash; on the graph's first run ``zbuf::check_schedule``
all-gathers the hash (8 bytes) and, only on a mismatch, the lists, then raises
``ScheduleMismatchError`` on every rank naming the first differing collective. Later runs skip
the check (one set lookup).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
import torch.fx

from .. import runtime

__all__ = [
    "ScheduleMismatchError",
    "collective_order",
    "collective_nodes",
    "fingerprint_of",
    "check_across_ranks",
]


class ScheduleMismatchError(RuntimeError):
    """Ranks compiled graphs whose collectives differ; continuing would hang or corrupt data."""


# Ops of the zbuf namespace that communicate (start carries the gather; wait/release do not).
# ``all_gather`` and ``reduce_scatter`` are the functional forms autograd traces; the pass replaces
# them, and check_token_chain (rewrite.py) refuses a graph in which one is left.
_COLLECTIVE_OPS = ("all_gather_start", "reduce_scatter_start", "all_gather", "reduce_scatter")

# (group_name, fingerprint) pairs every rank agreed on; filled by check_across_ranks.
_CHECKED: set[tuple[str, str]] = set()


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


def fingerprint_of(order: list[str]) -> str:
    return hashlib.sha256("\n".join(order).encode()).hexdigest()[:16]


def _device_for(pg: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_across_ranks(group_name: str, fingerprint: str, collectives: str) -> None:
    """See [Note: collective order check]. ``collectives`` is the JSON list of the order."""
    if (group_name, fingerprint) in _CHECKED:
        return
    pg = runtime.process_group(group_name)
    world = pg.size()
    if world > 1:
        mine = torch.tensor([int(fingerprint[:15], 16)], dtype=torch.int64, device=_device_for(pg))
        all_fp = torch.empty(world, dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(all_fp, mine, group=pg)
        if len(set(all_fp.tolist())) != 1:
            lists: list = [None] * world
            dist.all_gather_object(lists, collectives, group=pg)
            raise ScheduleMismatchError(_first_difference(lists, dist.get_rank(pg)))
    _CHECKED.add((group_name, fingerprint))


def _first_difference(lists: list[str], me: int) -> str:
    orders = [json.loads(x) for x in lists]
    ref = orders[me]
    for other, order in enumerate(orders):
        if order == ref:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref, order)) if a != b), min(len(ref), len(order)))
        a = ref[i] if i < len(ref) else "<end of graph>"
        b = order[i] if i < len(order) else "<end of graph>"
        return (
            f"ranks compiled graphs with different collective orders: collective #{i} is {a} on "
            f"rank {me} but {b} on rank {other} ({len(ref)} vs {len(order)} collectives). Every "
            "rank must run the same model code on the same input shapes; look for rank-dependent "
            "control flow or data-dependent shapes."
        )
    return "ranks disagree on the schedule fingerprint although their collective lists are equal"
