"""One schema per distinct region call while AOTAutograd traces the outer graph.

[Note: one schema per region]
torch 2.11 asks ``invoke_subgraph.gen_schema`` at every call of a nested compile region it
traces: the autograd key asks before each forward call (to refuse input mutation in training),
and the functionalization key asks at each forward and each backward call (whether to
auto-functionalize). ``gen_schema`` re-traces the body with ``make_fx`` (``materialize_as_graph``)
to find what it mutates. So AOTAutograd's joint trace of a model of N identical blocks traces the
block body about 3N times more, although it partitions and lowers the body once: on CPU, with the
tiny preset, those re-traces were the phase that grew most with the number of layers
(benches/results/compile_scaling_cpu.md).

The schema is a function of the body graph and of the operands' kinds only (a FunctionSchema of
argument types, mutated-argument flags and output types; a GraphModule's mutations are in its
nodes, not in the operand values). ``SchemaMemo`` keeps the first schema of each (body, identifier,
operand metadata) for the duration of one backend call and answers the repeats from it; the body
is keyed by identity and held, so an id cannot be reused within the call. A callable body that is
not a GraphModule (a functionalization wrapper) is never memoised.

It works through the one public name the HOP calls, ``invoke_subgraph.gen_schema``: an attribute
of the HOP instance set for the duration of the call and removed after it (compiles run under
Dynamo's compile lock, one at a time). torch's own fix (pytorch/pytorch#184646, caching the
schema in the per-compile ``InvokeSubgraphCache``) makes this redundant: with a torch that has it,
``SchemaMemo`` hits nothing and can be deleted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx

__all__ = ["SchemaMemo"]

REGION_OP = torch.ops.higher_order.invoke_subgraph


def _operand_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
    if isinstance(x, (int, float, bool, str)) or x is None:
        return (type(x).__name__, x)
    return ("?", id(x))  # a SymInt, a generator, an opaque object: only the same one repeats


class SchemaMemo:
    """The schemas of the region calls of one compile ([Note: one schema per region])."""

    def __init__(self) -> None:
        self._schemas: dict[tuple, Any] = {}
        self._bodies: list[torch.fx.GraphModule] = []  # held: their ids key the memo
        self.asked = 0
        """Schemas asked for during the compile."""
        self.generated = 0
        """Schemas generated (each one a trace of a body); the rest came from the memo."""

    def _gen_schema(self, subgraph, identifier, *operands):
        self.asked += 1
        key = None
        if isinstance(subgraph, torch.fx.GraphModule):
            aliases = tuple(next(j for j, y in enumerate(operands) if y is x) for x in operands)
            key = (id(subgraph), identifier, aliases, tuple(_operand_key(x) for x in operands))
            if key in self._schemas:
                return self._schemas[key]
        self.generated += 1
        schema = type(REGION_OP).gen_schema(REGION_OP, subgraph, identifier, *operands)
        if key is not None:
            self._bodies.append(subgraph)
            self._schemas[key] = schema
        return schema

    @contextlib.contextmanager
    def active(self) -> Iterator["SchemaMemo"]:
        """Answer ``invoke_subgraph``'s schema requests from the memo inside the block."""
        if "gen_schema" in REGION_OP.__dict__:  # an enclosing compile's memo: leave it
            yield self
            return
        REGION_OP.gen_schema = self._gen_schema
        try:
            yield self
        finally:
            del REGION_OP.gen_schema
            self._bodies.clear()
            self._schemas.clear()
