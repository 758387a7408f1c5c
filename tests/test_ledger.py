"""The memory package's pure parts: the ledger's quantities ([Note: the ledger] in
zbuf/memory/ledger.py), the planners' phases ([Note: one planner interface] in planner.py) and the
pool budget's one writer ([Note: one writer of the pool's budget] in pool_budget.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zbuf.memory import Ledger, PlanPhase, PlanPhases, pool_budget
from zbuf.memory.agreement import stable_budget
from zbuf.memory.ledger import MARGIN_DIVISOR, measured_room, without_margin
from zbuf.pool import GatherBufferPool

GiB = 1 << 30
byte_counts = st.integers(min_value=0, max_value=200 * GiB)


@given(limit=byte_counts, fw=byte_counts, bw=byte_counts, excess=st.integers(0, GiB),
       frag=st.integers(0, 1_000_000), act=byte_counts, held=st.none() | byte_counts)
def test_the_ledger_derives_each_quantity_from_the_agreed_ones(limit, fw, bw, excess, frag, act,
                                                               held):
    ledger = Ledger.agreed(None, torch.device("cpu"), limit_bytes=limit, torch_forward_bytes=fw,
                           torch_backward_bytes=bw, torch_live_bytes=fw, optimizer_bytes=None,
                           pool_excess_bytes=excess, fragmentation_ppm=frag)
    usable = limit - limit // MARGIN_DIVISOR - excess
    assert ledger.usable_bytes == usable == without_margin(limit) - excess
    assert ledger.gather_budget_bytes == stable_budget(usable - max(fw, bw))
    assert 1 <= ledger.gather_budget_bytes <= max(1, usable - max(fw, bw))
    activations = {"forward": act}
    assert ledger.room_bytes(activations, held) == measured_room(
        usable, {"forward": fw, "backward": bw}, activations, held, frag)
    assert ledger.optimizer_bytes is None


def test_a_planner_enters_each_phase_once_and_in_order():
    phases = PlanPhases()
    assert phases.phase is PlanPhase.MEASURING
    assert phases.enter(PlanPhase.GROWN) and not phases.enter(PlanPhase.GROWN)
    assert phases.enter(PlanPhase.SETTLED) and not phases.enter(PlanPhase.GROWN)
    late = PlanPhases()  # a settle without a grow (nothing was measuring) is still once
    assert late.enter(PlanPhase.SETTLED) and not late.enter(PlanPhase.SETTLED)


def test_the_pool_budget_moves_only_as_its_writer_says():
    pool = GatherBufferPool("cpu", budget_bytes=1 << 20)
    pool_budget.size_by_first_runs(pool)
    assert pool.stats().budget_bytes == 0
    pool_budget.raise_to(pool, 4096)
    pool_budget.raise_to(pool, 1024)  # a plan that needs less never lowers it
    assert pool.stats().budget_bytes == 4096
    assert pool_budget.set_to(pool, 2048) == 2048
    pool_budget.keep_weights(pool, {7: 1000})
    assert pool.stats().budget_bytes == 2048 + pool.capacity_for(1000)
    pool_budget.keep_weights(pool, {})
    assert pool.stats().budget_bytes == 2048


@pytest.mark.parametrize("nbytes", [0, 1, 4096])
def test_set_to_clamps_to_the_hard_cap(nbytes):
    pool = GatherBufferPool("cpu", budget_bytes=0, hard_cap_bytes=2048)
    assert pool_budget.set_to(pool, nbytes) == min(nbytes, 2048)
