"""The FX passes of the zbuf backend, as Inductor custom-pass objects (also used by aot_eager).

``ZbufPartitioner`` (joint graph, before partitioning): applies the recompute mode to the
checkpointed regions (recompute.py: as written, planned within the budget, or kept), tags every
gather and its view/cast users ``MUST_RECOMPUTE`` so backward re-gathers instead of saving full
weights, except the gathers selective persistence keeps (``MUST_SAVE``: persist.py), and runs
``min_cut_rematerialization_partition`` (more than once when the recompute plan is measured).
``GatherSchedulePass`` (forward and backward graphs, post-grad): plans (schedule.py) and rewrites
(rewrite.py) each graph in the steps ``plan_and_rewrite`` lists, and adds the every-run rank check
([Note: collective order check] in fingerprint.py) and the first-run pool sizing.
``PlanState`` carries what the partitioner decided to the schedule pass of the same compile.

[Note: pass uuid]
Inductor's FX-graph cache skips the passes on a hit, so a pass's ``uuid`` must change whenever its
output could: it hashes the sources of ``cache_key_modules()`` (every zbuf module the passes import,
directly or not, found by walking their import statements: moving a helper into a new module
cannot silently drop it from the key), the options, the planning input that is not in the
graph (the agreed free memory is the option ``free_memory_bytes``; the world size shows in the
shard shapes), and torch's version.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx
from torch._dynamo.utils import dynamo_timed
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn
from torch.profiler import record_function

from ..kept_weights import HOLDS, NEITHER, TAKES
from ..optimizer_in_backward import BATCH_BYTES
from . import budget as budget_mod
from . import recompute, report
from .fingerprint import collective_order, describe_graph, fingerprint_of
from .graph_info import gather_nodes, gradient_shard_bytes, group_and_device, summarize
from .options import CompileOptions
from .persist import Persisted, tag_for_regather
from .region_graphs import forward_region_inputs, is_body, mark_body, prepare_body_joint
from .rewrite import (check_token_chain, hold_released_buffers, rewrite,
                      step_gradients_in_backward, thread_reduce_scatters)
from .schedule import buffer_counts, plan_schedule
from .tied import merge_reduce_scatters

__all__ = ["ZbufPartitioner", "GatherSchedulePass", "PlanState", "cache_key_modules",
           "imported_modules"]

zbuf = torch.ops.zbuf


def imported_modules(module: str, prefix: str = "zbuf") -> list[str]:
    """``module`` and every module of package ``prefix`` that its source imports, directly or
    not, by any import statement (also one inside a function), sorted; package ``__init__``
    files are left out (they only re-export: the modules they name are followed themselves),
    and so is compiled code (the extension's behaviour is the pool's, not the plan's)."""
    find = functools.cache(importlib.util.find_spec)  # a lookup searches sys.path: once each
    reached: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        spec = find(name)
        if name in reached or spec is None or not (spec.origin or "").endswith(".py"):
            continue
        reached.add(name)
        todo.extend(_imports_of(name, spec, prefix, find))
    return sorted(m for m in reached if not find(m).submodule_search_locations)


def _imports_of(module: str, spec, prefix: str, find) -> set[str]:
    """The modules of ``prefix`` named by the import statements of ``module``'s source."""
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    with open(spec.origin, "rb") as f:
        tree = ast.parse(f.read(), spec.origin)
    found: set[str] = set()

    def ours(name: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if ours(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            if not ours(base):
                continue
            is_package = find(base).submodule_search_locations is not None
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # "from .. import ops": the module itself; "from ..param import X": the module.
                found.add(sub if is_package and find(sub) is not None else base)
    return found - {module}


def _statements(body: list[ast.stmt]):
    """Every statement of ``body``, nested ones included (imports are statements: expressions,
    most of a module's nodes, are not walked)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _statements(inner)


@functools.cache
def cache_key_modules() -> tuple[str, ...]:
    """The modules whose sources the pass uuid hashes ([Note: pass uuid]): this one and every
    zbuf module it imports, directly or not (derived from the import statements, so a helper
    moved into a new module is in the key as soon as a pass imports it). Found on the first
    compile, not at import."""
    return tuple(imported_modules(__name__))


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for name in cache_key_modules():
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


class PlanState:
    """What the partitioner hands to the post-grad pass of the same compile.

    One instance per Dynamo graph (the backend creates it), shared by the partitioner (producer
    of ``persisted``, see [Note: selective persistence] in persist.py, and ``recompute``) and the
    schedule pass of
    the forward and backward graphs (consumer).
    """

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.persisted = Persisted()
        self.recompute: recompute.RecomputeStats | None = None
        """What the partition kept for backward and what backward recomputes (recompute.py)."""
        self.partitioned = False
        """The partitioner split this graph into forward and backward (a training graph; an
        inference graph has no backward to keep weights for)."""

    def uuid(self) -> str:
        return f"{_source_hash()}:{self.options.digest()}:{torch.__version__}"


class ZbufPartitioner(CustomPartitionerFn):
    def __init__(self, state: PlanState) -> None:
        self.state = state

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        kwargs.setdefault("compiler", "inductor")
        opts = self.state.options

        def min_cut(joint: torch.fx.GraphModule):
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        # dynamo_timed: torch's compile timer, which zbuf.train.compile_phases reads.
        if not joint_inputs:  # a region body's joint graph comes without inputs
            with record_function("zbuf::tag_for_regather"), dynamo_timed("zbuf.tag_for_regather"):
                prepare_body_joint(gm.graph, opts)  # [Note: region bodies]
            fw, bw = min_cut(gm)
            mark_body(fw, bw)
            return fw, bw

        def tag(joint: torch.fx.Graph, activation_peak: int | None) -> Persisted:
            with record_function("zbuf::tag_for_regather"), dynamo_timed("zbuf.tag_for_regather"):
                return tag_for_regather(joint, opts, activation_peak)

        self.state.partitioned = True
        forward_region_inputs(gm.graph)  # [Note: region bodies]
        with record_function("zbuf::partition"):
            fw, bw, persisted, stats = recompute.partition(gm, kwargs["num_fwd_outputs"], opts,
                                                           min_cut, tag)
        # The partition chosen carries its own persistence ([Note: budgeted recompute]).
        self.state.persisted, self.state.recompute = persisted, stats
        return fw, bw

    def uuid(self) -> str:
        return "partitioner:" + self.state.uuid()


def _is_backward_graph(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def _drop_dead_gathers(graph: torch.fx.Graph) -> None:
    """Gathers whose output nobody reads cost a collective for nothing."""
    for g in gather_nodes(graph):
        if not g.users:
            graph.erase_node(g)


class GatherSchedulePass(CustomGraphPass):
    def __init__(self, state: PlanState) -> None:
        self.state = state

    def uuid(self) -> str:
        return "schedule:" + self.state.uuid()

    def __call__(self, graph: torch.fx.Graph) -> None:
        if is_body(graph):  # planned as part of the outer graph ([Note: region bodies])
            return
        with record_function("zbuf::plan_and_rewrite"), dynamo_timed("zbuf.schedule_pass"):
            self.plan_and_rewrite(graph)

    def plan_and_rewrite(self, graph: torch.fx.Graph) -> None:
        """The schedule pass, in this order (each step works on what the one before left):

        1. merge tied reduce-scatters ([Note: merging reduce-scatters] in tied.py);
        2. drop dead gathers;
        3. summarize: localize view chains, read the planner's input (graph_info.py);
        4. plan the gathers under this graph's budget (schedule.py; a backward's budget less the
           bytes persistence kept from forward);
        5. rewrite the gathers into start / wait / release on the schedule token (rewrite.py);
        6. thread the reduce-scatters onto the token ([Note: reduce-scatter overlap]); with
           ``optimizer_in_backward``, step each gradient shard once it is reduced ([Note:
           optimizer in backward]); end the graph holding every released buffer ([Note: the
           pool's memory is not Inductor's]);
        7. fingerprint the input shapes and collective order, build the graph's record (report.py);
        8. add the every-run check and the first-run pool sizing (``zbuf::check_schedule``);
        9. verify the token chain and the graph, then register the record.
        """
        opts, persisted = self.state.options, self.state.persisted
        kind = "backward" if _is_backward_graph(graph) else "forward"
        # dynamo_timed spans: zbuf's passes in the first step's phases (compile_phases.py).
        with dynamo_timed("zbuf.plan"):
            merge_reduce_scatters(graph)  # 1
            _drop_dead_gathers(graph)  # 2
            index = summarize(graph, opts)  # 3
            group_name, device = group_and_device(graph)
            act_profile = budget_mod.planning_profile(graph, opts)
            # [Note: gradients live in backward] in budget.py
            gradients = gradient_shard_bytes(graph)
            reserve = budget_mod.gradient_reserve(opts, gradients, backward=kind == "backward")
            token, sched = None, None
            if index.gathers:  # 4
                peak_act = int(act_profile.max()) if len(act_profile) else 0
                requested = budget_mod.graph_budget(opts, device, peak_act, graph, reserve)
                kept = persisted.nbytes if kind == "backward" else 0
                # Persisted weights are live through backward: they come off its budget.
                sched = plan_schedule(index.summary, max(1, requested - kept), opts)
                # [Note: no plan above its memory] in budget.py.
                both = (act_profile + sched.profile if len(act_profile) == len(sched.profile)
                        else np.array([peak_act + sched.peak_live_bytes]))
                budget_mod.check_plan_fits(
                    opts, device, kind=kind, peak_bytes=int(both.max(initial=0)) + kept,
                    activation_peak=peak_act,
                    gathered_peak=sched.peak_live_bytes + kept, reserve_bytes=reserve)
        with dynamo_timed("zbuf.rewrite"):
            if sched is not None:
                # [Note: weights kept at run time] in zbuf/kept_weights.py
                role = (TAKES if kind == "backward"
                        else HOLDS if self.state.partitioned else NEITHER)
                token = rewrite(graph, index, sched, role)  # 5
            token = thread_reduce_scatters(graph, token)  # 6
            if opts.optimizer_in_backward and kind == "backward":
                step_gradients_in_backward(graph, token, BATCH_BYTES)
            hold_released_buffers(graph, token)  # [Note: the pool's memory is not Inductor's]
        with dynamo_timed("zbuf.fingerprint"):
            order = collective_order(graph)  # 7
            description = describe_graph(graph, order)
            fp = fingerprint_of(description)
        checked = bool(order) and token is not None
        rec = report.schedule_record(
            graph, kind=kind, index=index, sched=sched, options=opts,
            persistent_bytes=persisted.nbytes, activation_profile=act_profile, order=order,
            fingerprint=fp, checked=checked, recompute=self.state.recompute,
            gradient_bytes=gradients)
        if checked:  # 8
            counts = buffer_counts(index.summary, sched) if sched else {}
            if kind == "backward":
                # Persisted weights come back to their pools during backward ([Note: pool sizing]).
                for pool, nbytes in persisted.buffers:
                    per_size = counts.setdefault(pool, {})
                    per_size[nbytes] = per_size.get(nbytes, 0) + 1
            entries = [(pool, size, n) for pool, per_size in counts.items() for size, n in per_size.items()]
            with graph.inserting_after(token):
                chk = graph.call_function(
                    zbuf.check_schedule.default,
                    (token, group_name if group_name is not None else self._group_of_collectives(graph),
                     fp if opts.check_fingerprint else "", description, [e[0] for e in entries],
                     [e[1] for e in entries], [e[2] for e in entries], rec.param_ids[0],
                     rec.to_json()),
                )
                chk.meta["val"] = None
        check_token_chain(graph, token)  # 9
        graph.lint()
        report.record(rec, index.summary)

    @staticmethod
    def _group_of_collectives(graph: torch.fx.Graph) -> str:
        for n in graph.nodes:
            if n.target is zbuf.reduce_scatter_start.default:
                return n.args[4]
        raise AssertionError("collectives without a zbuf group; this is a zbuf bug")
