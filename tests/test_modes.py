"""One table of modes ([Note: one table of modes] in zbuf/compile/modes.py): every legal
combination trains as the unsharded model does (one process, CPU; on CUDA in
tests/gpu/test_modes_gpu.py, through the same ``parity.modes_train_as_unsharded``), every
refused one is refused with one line by ``zbuf.compile``, by the backend's options and by ``zbuf
train`` alike, and no option is silently ignored."""

from __future__ import annotations

import pytest
import torch

import zbuf.compile
from parity import mode_name, modes_model, modes_train_as_unsharded
from zbuf.compile.modes import RULES, Modes, legal_modes, refusal
from zbuf.compile.options import CompileOptions
from zbuf.shard import shard

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

LEGAL = legal_modes()


def test_the_table_counts_what_the_issue_counted():
    # The whole graph takes every recompute mode with the optimizer in backward or after it,
    # its state offloaded or not; blocks take no whole-graph mode; the optimizer's state offloads
    # under either structure (issue 38). Issue 39 counted ten with optimizer_in_backward, four
    # of them with compile_blocks_once, since deleted (issue 36).
    assert len(LEGAL) == 3 * 2 * 2 + 3 * 2
    assert sum(m.optimizer_in_backward for m in LEGAL) == 6
    assert {(m.recompute, m.optimizer_in_backward, m.offload_optimizer)
            for m in LEGAL if m.structure == "blocks"} == {
        (r, False, f) for r in ("checkpointed", "auto", "none") for f in (False, True)}


def test_every_rule_refuses_something_legal_modes_do_not_hold():
    every = [Modes(structure=s, recompute=r, optimizer_in_backward=o, offload_optimizer=f,
                   budget_bytes=b, activation_budget_bytes=a,
                   coalesce=k, optimizer=opt, fullgraph=fg)
             for s in ("graph", "blocks") for r in ("checkpointed", "auto", "none")
             for o in (False, True) for f in (False, True)
             for b in (False, True) for a in (False, True) for k in (False, True)
             for opt in (False, True) for fg in (False, True)]
    for rule in RULES:  # each rule is reachable, and a line renders for what it refuses
        hits = [m for m in every if rule.refuses(m)]
        assert hits, rule.line
        assert all(refusal(m) for m in hits)
    assert not any(refusal(m) for m in LEGAL)


@pytest.mark.parametrize("modes", LEGAL, ids=mode_name)
def test_every_legal_combination_trains_as_the_unsharded_model(modes):
    modes_train_as_unsharded(modes, torch.device("cpu"), inner="aot_eager")


@pytest.mark.parametrize("options, line", [
    (dict(structure="blocks", optimizer_in_backward=True),
     "structure='blocks' does not take optimizer_in_backward=True"),
    (dict(structure="graph", activation_budget_bytes=1 << 20),
     "activation_budget_bytes is the budget of recompute='auto'"),
    (dict(structure="blocks", coalesce=False), "coalesce_min_bytes would tune nothing"),
])
def test_a_refused_combination_is_one_line_from_zbuf_compile(options, line):
    model = shard(modes_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=line) as refused:
        zbuf.compile(model, optimizer=opt, inner="aot_eager", fullgraph=True, **options)
    assert "\n" not in str(refused.value)


def test_coalescing_is_honoured_or_refused_never_ignored():
    """The block frames gather each block with one collective: a coalesce option makes zbuf pick
    the whole graph, which reads it, and ``structure='blocks'`` refuses it."""
    assert CompileOptions(coalesce_max_bytes=1 << 20).graph_only
    assert not CompileOptions().graph_only
    model = shard(modes_model())
    compiled = zbuf.compile(model, inner="aot_eager", coalesce=False)
    assert compiled is not model  # the whole graph: torch.compile's wrapper, not the model itself
    with pytest.raises(ValueError, match="coalesce / coalesce_max_bytes"):
        CompileOptions(structure="blocks", coalesce_min_bytes=1)


def test_the_command_refuses_in_its_own_words():
    from zbuf.train.config import ConfigError, TrainConfig

    for options, line in [
        (dict(compile_structure="blocks", optimizer_in_backward=True),
         "--compile-structure blocks does not take --optimizer-in-backward"),
        (dict(compile_structure="blocks", ac="auto", gather_budget=1 << 30),
         "--compile-structure blocks with --ac auto plans the blocks' levels"),
    ]:
        with pytest.raises(ConfigError, match=line):
            TrainConfig(**options).resolve(cuda=False, world=2, bench=False)
