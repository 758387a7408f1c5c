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
nodes, not in the operand values). ``SchemaMemo`` keeps the first schema of each (body, operand
metadata) for the duration of one backend call and answers the repeats from it; the body is keyed
by identity and held, so an id cannot be reused within the call. A callable body that is not a
GraphModule (a functionalization wrapper) is never memoised. The identifier is not in the key,
only its type: the schema types it as a ``str`` argument and holds no value of it, and the
autograd function's forward asks again for the body it was asked about, under ``fw_<identifier>``
(one trace of the body less per compile).

The body of a backward call (``bw_<identifier>``) is the joint graph torch traced with ``make_fx``
(``trace_joint_graph_as_bwd``): already a graph of aten operators whose nodes carry their fake
values. ``gen_schema`` would trace it again, the costliest of the schema traces (on CPU, tiny
preset: 0.16 of the 0.26 CPU s the three took, the backward body being three times the forward's
nodes). Re-tracing a graph of ``OpOverload`` calls records the same calls on the same inputs (or
their decompositions, which mutate what the operator's schema says it mutates), so its mutated
inputs and outputs are the graph's own: ``schema_of_aten_graph`` reads them off the body (torch's own ``check_input_alias_and_mutation_return_outputs``, then the same
``HopSchemaGenerator`` steps as ``gen_schema``). It takes only a body whose every call is an
``OpOverload`` (or a ``getitem`` of one's results), whose placeholders are the operands and carry
fake values, and that asks for no decomposition table; anything else, or a torch without those
helpers, goes to ``gen_schema``. tests/test_compile_regions.py checks the two schemas equal on
the decoder's bodies, so a torch that changes ``gen_schema`` fails there, not in a compile.

It works through the one public name the HOP calls, ``invoke_subgraph.gen_schema``: an attribute
of the HOP instance set for the duration of the call and removed after it (compiles run under
Dynamo's compile lock, one at a time). torch's own fix (pytorch/pytorch#184646, caching the
schema in the per-compile ``InvokeSubgraphCache``) makes the memo redundant: with a torch that has
it, ``SchemaMemo`` hits nothing but the backward body, whose one trace the read-off still saves.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
import torch.fx

__all__ = ["SchemaMemo", "schema_of_aten_graph"]

REGION_OP = torch.ops.higher_order.invoke_subgraph


def _operand_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
    if isinstance(x, (int, float, bool, str)) or x is None:
        return (type(x).__name__, x)
    return ("?", id(x))  # a SymInt, a generator, an opaque object: only the same one repeats


def _is_aten_graph(body: torch.fx.GraphModule, operands: tuple) -> bool:
    """Whether ``body`` is a graph ``make_fx`` recorded, whose schema can be read off its nodes
    ([Note: one schema per region])."""
    placeholders = body.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(operands) or not all("val" in p.meta for p in placeholders):
        return False
    if body.meta.get("nested_region_config") is not None:  # a re-trace would decompose
        return False
    return all(n.op in ("placeholder", "output") or
               (n.op == "call_function" and (isinstance(n.target, torch._ops.OpOverload)
                                             or n.target is operator.getitem))
               for n in body.graph.nodes)


def schema_of_aten_graph(body: torch.fx.GraphModule, identifier: Any, *operands: Any) -> Any:
    """``invoke_subgraph.gen_schema(body, identifier, *operands)`` without re-tracing ``body``,
    or None where that is not known to give the same schema ([Note: one schema per region])."""
    try:  # torch private: torch 2.11's gen_schema, less its materialize_as_graph
        from torch._higher_order_ops.schema import HopSchemaGenerator
        from torch._higher_order_ops.utils import check_input_alias_and_mutation_return_outputs
    except ImportError:
        return None
    if not _is_aten_graph(body, operands):
        return None
    *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(body)
    gen = HopSchemaGenerator(REGION_OP)
    gen.add_arg("subgraph", body)
    gen.add_arg("identifier", identifier)
    for i, arg in enumerate(operands):
        gen.add_arg(f"arg{i}", arg, is_mutated=i in mutated)
    for out in outputs:
        gen.add_output(out)
    return gen.gen_schema()


class SchemaMemo:
    """The schemas of the region calls of one compile ([Note: one schema per region])."""

    def __init__(self) -> None:
        self._schemas: dict[tuple, Any] = {}
        self._bodies: list[torch.fx.GraphModule] = []  # held: their ids key the memo
        self.asked = 0
        """Schemas asked for during the compile."""
        self.generated = 0
        """Schemas generated (a trace of a body each, unless read off an aten graph); the rest
        came from the memo."""

    def _gen_schema(self, subgraph, identifier, *operands):
        self.asked += 1
        key = None
        if isinstance(subgraph, torch.fx.GraphModule):
            aliases = tuple(next(j for j, y in enumerate(operands) if y is x) for x in operands)
            key = (id(subgraph), type(identifier), aliases,
                   tuple(_operand_key(x) for x in operands))
            if key in self._schemas:
                return self._schemas[key]
        self.generated += 1
        schema = None
        if key is not None:
            schema = schema_of_aten_graph(subgraph, identifier, *operands)
        if schema is None:
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
