"""The recompute planner (compile/recompute_plan.py) on random regions: budget, order, monotony."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbuf.compile.recompute_plan import RegionLevel, RegionSpec, hull_steps, plan_recompute

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))


@st.composite
def regions(draw):
    specs = []
    for i in range(draw(st.integers(0, 8))):
        base = draw(st.floats(0, 1e-2))
        levels = [RegionLevel("recompute", 0, base)]
        for name in ("selective", "keep")[: draw(st.integers(0, 2))]:
            levels.append(RegionLevel(name, draw(st.integers(0, 1 << 12)), draw(st.floats(0, 1e-2))))
        specs.append(RegionSpec(f"r{i}", draw(st.integers(0, 100)), tuple(levels)))
    return specs


def _saved(specs, plan) -> float:
    return sum(s.levels[0].recompute_seconds - s.levels[lv].recompute_seconds
               for s, lv in zip(specs, plan.levels))


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regions(), st.integers(0, 1 << 12), st.integers(1, 1 << 15))
def test_random_regions_stay_within_the_budget_and_leave_no_room(specs, base, budget):
    plan = plan_recompute(specs, base, budget)
    assert plan.budget_bytes == max(budget, base)
    kept = sum(s.levels[lv].extra_bytes for s, lv in zip(specs, plan.levels))
    assert plan.kept_bytes == kept
    assert plan.modelled_peak_bytes == base + kept <= plan.budget_bytes
    assert plan.saved_seconds == pytest.approx(_saved(specs, plan))
    assert plan.saved_seconds >= -1e-15  # never worse than recomputing as written
    # Maximal: no upgrade that saves time fits in what is left.
    room = plan.budget_bytes - plan.modelled_peak_bytes
    for s, lv in zip(specs, plan.levels):
        cur = s.levels[lv]
        for other in s.levels:
            if other.recompute_seconds < cur.recompute_seconds:
                assert other.extra_bytes - cur.extra_bytes > room, (s, lv, other, room)


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regions(), st.integers(0, 1 << 12), st.integers(1, 1 << 14), st.integers(0, 1 << 14))
def test_a_larger_budget_never_recomputes_more(specs, base, budget, more):
    small = plan_recompute(specs, base, budget)
    large = plan_recompute(specs, base, budget + more)
    assert _saved(specs, large) >= _saved(specs, small) - 1e-12


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(regions(), st.integers(1, 1 << 12))
def test_no_room_recomputes_everything_and_ample_room_the_least(specs, base):
    # No room (a budget below the base is raised to it): only levels that cost no bytes (level 0,
    # or a free one that saves time).
    plan = plan_recompute(specs, base, 1)
    assert plan.budget_bytes == base
    assert all(s.levels[lv].extra_bytes == 0 for s, lv in zip(specs, plan.levels))
    total = base + sum(max(lv.extra_bytes for lv in s.levels) for s in specs)
    plan = plan_recompute(specs, base, max(total, 1))
    for s, lv in zip(specs, plan.levels):
        assert s.levels[lv].recompute_seconds == min(x.recompute_seconds for x in s.levels)


def _block(key, position, sel_bytes=100, keep_bytes=250, t=(10.0, 2.0, 0.0)):
    return RegionSpec(key, position, (RegionLevel("recompute", 0, t[0]),
                                      RegionLevel("selective", sel_bytes, t[1]),
                                      RegionLevel("keep", keep_bytes, t[2])))


def test_keeps_while_it_fits_cheapest_to_recompute_first():
    # Three identical blocks: "selective" saves 8 s for 100 bytes, "keep" 2 s more for 150 more.
    specs = [_block(f"b{i}", i) for i in range(3)]
    assert plan_recompute(specs, 1000, 1099).levels == (0, 0, 0)
    # Later blocks first: they are the first backward needs.
    assert plan_recompute(specs, 1000, 1100).levels == (0, 0, 1)
    assert plan_recompute(specs, 1000, 1300).levels == (1, 1, 1)
    assert plan_recompute(specs, 1000, 1450).levels == (1, 1, 2)
    assert plan_recompute(specs, 1000, 1750).levels == (2, 2, 2)
    # A block that is cheap to recompute (1 s) is recomputed before expensive ones.
    cheap = _block("cheap", 9, t=(1.0, 0.5, 0.0))
    plan = plan_recompute([*specs, cheap], 1000, 1300)
    assert plan.levels == (1, 1, 1, 0)
    assert plan.saved_seconds == pytest.approx(24.0)


def test_hull_skips_a_level_below_the_line_but_fill_uses_it():
    # "selective" saves 1 s for 100 bytes, "keep" 10 s for 200: selective lies below the line.
    spec = _block("b", 0, sel_bytes=100, keep_bytes=200, t=(10.0, 9.0, 0.0))
    assert [(lo, hi) for lo, hi, _, _ in hull_steps(spec)] == [(0, 2)]
    assert plan_recompute([spec], 0, 200).levels == (2,)
    assert plan_recompute([spec], 0, 150).levels == (1,)  # the room left is filled


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_recompute([], 0, 0)
    with pytest.raises(ValueError, match="level 0"):
        RegionSpec("r", 0, (RegionLevel("recompute", 5, 1.0),))
    with pytest.raises(ValueError, match="no levels"):
        RegionSpec("r", 0, ())
