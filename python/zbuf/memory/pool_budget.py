"""The gather-buffer pool's budget: the one place in zbuf that sets it.

[Note: one writer of the pool's budget]
How many bytes the pool may keep in its own blocks is a memory decision of the step, so it is
made here and nowhere else in zbuf (``tests/test_structure.py`` fails on a ``set_budget`` call
outside ``zbuf/memory/``). Each way it moves has its own name, and its caller says why:

* ``size_by_first_runs``: a compiled model's plans size the pool, so its budget starts at 0
  (``StepMemory``, and again after a re-plan compiled new plans);
* ``raise_to``: a graph's first run raises the budget to what its plan holds at once, the blocks
  held for kept weights included ([Note: pool sizing] in compile/schedule.py); it never lowers it;
* ``set_to``: a budget fixed by its caller: block frames' two blocks live and the parameters
  outside them, plus the blocks kept for backward ([Note: block levels] in
  compile/block_replan.py); an eager model's ``--pool-budget``;
* ``keep_weights``: a new keep-set moves the budget by the change in kept blocks' capacity
  ([Note: weights kept at run time] in zbuf/kept_weights.py), so holding a block never pushes
  another gather outside the pool.

Below these the pool guards the device on its own: its default budget and hard cap
(``rust/python/pool.rs``: the device's total / 32 and / 4) and its pressure policy, which only
ever shrinks the budget when torch's allocator retries (``rust/pressure.rs``: a quarter of the
free memory). Those are the pool's defences, not decisions about the step: a ``set_budget`` here
is clamped to the hard cap, and the pressure policy may lower it again, but never below the
floor each of these sets with the budget (``GatherBufferPool.set_floor``). A budget the plan
sized is the gathers' working set: they need those bytes at once whatever the budget says, so
shrinking it frees nothing for torch and serves every gather by a device allocation of its own
(qwen3-32b as rank 0 of 8: the pressure policy took the blocks' two-block budget from 4.7 GB to
20 MB in twelve steps, and the pool then made about 640 allocations a step, each freed on
release; benches/results/onepath32b.md). Above the floor (the pool's default budget, an eager
model's) the policy shrinks as before.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["size_by_first_runs", "raise_to", "set_to", "keep_weights"]


def _planned(pool, nbytes: int) -> int:
    """Budget and floor ``nbytes``: the plan's working set, which the pressure policy keeps."""
    pool.set_floor(nbytes)
    return pool.set_budget(nbytes)


def size_by_first_runs(pool) -> None:
    """Budget 0: the plans' first runs size the pool to exactly what they need (``raise_to``)."""
    _planned(pool, 0)


def raise_to(pool, nbytes: int) -> None:
    """At least ``nbytes``: a plan's first run needs them at once ([Note: pool sizing])."""
    stats = pool.stats()
    if stats.budget_bytes < nbytes or stats.floor_bytes < nbytes:
        _planned(pool, max(stats.budget_bytes, nbytes))


def set_to(pool, nbytes: int) -> int:
    """Exactly ``nbytes`` (clamped to the pool's hard cap); returns the effective budget."""
    return _planned(pool, nbytes)


def keep_weights(pool, kept: Mapping[int, int]) -> None:
    """Make ``kept`` (param id -> gathered bytes) ``pool``'s keep-set and move its budget by the
    change in the kept blocks' capacity. Every rank, same program point (between steps)."""
    delta = pool.kept.set(pool, kept)
    if delta:
        _planned(pool, max(0, pool.stats().budget_bytes + delta))
