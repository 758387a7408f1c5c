"""Gathered weights that forward keeps for backward, chosen at run time: a pool's keep-set.

[Note: weights kept at run time]
Which gathered weights forward keeps for backward (selective persistence, [Note: selective
persistence] in compile/persist.py) used to be graph structure: the partitioner saved the kept
weights as forward outputs, so changing the set after the measured step recompiled the whole
model (benches/results/memory_history.md). Now the graphs a measured plan compiles always re-gather
in backward, and the keep-set is data, held by the pool the weights are gathered into
(``GatherBufferPool.kept``), never by a process-global:

* a forward graph's ``zbuf::gather_buffer`` of a weight in the keep-set notes the buffer
  (``note_forward_gather``); the release of that buffer does not return it to the pool but holds
  it (``hold_if_kept``): the block stays checked out, so no other gather is handed it, and it
  keeps the weight as forward gathered it;
* a backward graph's ``zbuf::gather_buffer`` of a held weight returns the held buffer
  (``take``), and the start of its collective skips it (no collective: the buffer is already
  filled); the backward releases it after its readers, as any buffer;
* a forward gather always gathers: a buffer still held from an earlier forward whose backward
  never ran (a loss dropped before its backward; an inference graph, compiled under
  ``no_grad``, neither holds nor takes) goes back to the pool and the weight is
  gathered afresh, so a held buffer is never older than the forward that made it.

Every rank must skip the same collectives: the keep-set is chosen by a pure function of
rank-agreed inputs (``persist.choose_kept``) at the same program point of every rank (the
re-plan, compile/replan.py), and the every-run collective order check folds the keep-set into
the graph's fingerprint (``fingerprint``), so ranks with different keep-sets stop with
``ScheduleMismatchError`` instead of pairing a skipped gather with a real one.

The held bytes count against the pool's budget: setting a keep-set moves the budget by the
kept blocks' capacity (``zbuf.memory.pool_budget.keep_weights``), and a graph's first-run sizing
adds them too ([Note: pool sizing] in compile/schedule.py), so holding a block never pushes
another gather outside the pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Optional

import torch

__all__ = ["KeptWeights", "HOLDS", "TAKES", "NEITHER"]

NEITHER = 0
"""``gather_buffer``'s role where nothing is kept or reused: an inference graph, a direct call.
(Graphs whose compile kept weights in the structure get the roles too; their pools' keep-sets
stay empty: only the re-planner of ``zbuf.compile`` sets one.)"""
HOLDS = 1
"""In a training forward graph: a kept weight's buffer is held at its release."""
TAKES = 2
"""In a backward graph: a held weight's buffer is returned without a collective."""


class KeptWeights:
    """One pool's keep-set and the buffers it holds ([Note: weights kept at run time])."""

    __slots__ = ("nbytes", "held", "_holding", "_digest", "_fingerprints")

    # The pool is passed to the methods that need it, not kept: the pool holds this object, and
    # a reference back would keep a pool that nothing uses alive until a garbage collection.

    def __init__(self) -> None:
        self.nbytes: dict[int, int] = {}
        """param id -> gathered (padded) bytes of each weight forward keeps for backward."""
        self.held: dict[int, torch.Tensor] = {}
        """param id -> the buffer forward released and backward has not taken yet."""
        self._holding: dict[int, int] = {}  # storage pointer -> param id, gathered by forward
        self._digest = ""
        self._fingerprints: dict[str, tuple[str, str]] = {}

    def __bool__(self) -> bool:
        return bool(self.nbytes)

    # -- the keep-set -------------------------------------------------------------------------

    def set(self, pool, kept: Mapping[int, int]) -> int:
        """Keep ``kept`` (param id -> gathered bytes) from now on. Buffers held for weights no
        longer kept go back to the pool. Returns the change in the kept blocks' capacity, by
        which the pool's budget moves: ``zbuf.memory.pool_budget.keep_weights`` calls this and
        moves it ([Note: one writer of the pool's budget]). Call on every rank at the same
        program point (between steps)."""
        old = self.capacity_bytes(pool)
        for param_id in [p for p in self.held if p not in kept]:
            pool.release(self.held.pop(param_id))
        self._holding = {ptr: p for ptr, p in self._holding.items() if p in kept}
        self.nbytes = dict(sorted(kept.items()))
        self._digest = (hashlib.sha256(repr(sorted(self.nbytes)).encode()).hexdigest()[:16]
                        if self.nbytes else "")
        self._fingerprints.clear()
        return self.capacity_bytes(pool) - old

    def capacity_bytes(self, pool) -> int:
        """Bytes of ``pool``'s blocks the kept weights take while held."""
        return sum(pool.capacity_for(n) for n in self.nbytes.values())

    def total_bytes(self) -> int:
        """Gathered bytes of the kept weights."""
        return sum(self.nbytes.values())

    # -- what the graph ops do ----------------------------------------------------------------

    def note_forward_gather(self, pool, param_id: int, buf: torch.Tensor) -> None:
        """A forward graph gathers ``param_id`` into ``buf``: hold it at its release if kept."""
        if param_id not in self.nbytes:
            return
        stale = self.held.pop(param_id, None)
        if stale is not None:  # its backward never ran: gather afresh
            pool.release(stale)
        self._holding[buf.untyped_storage().data_ptr()] = param_id

    def hold_if_kept(self, t: torch.Tensor) -> bool:
        """At a release: hold ``t`` instead of returning it when forward gathered a kept weight
        into it. Returns whether it was held."""
        param_id = self._holding.pop(t.untyped_storage().data_ptr(), None)
        if param_id is None:
            return False
        self.held[param_id] = t
        return True

    def take(self, param_id: int) -> Optional[torch.Tensor]:
        """The buffer held for ``param_id`` (an alias of it: the graph releases it as its own),
        or None."""
        t = self.held.pop(param_id, None)
        if t is None:
            return None
        # Not ``view``: [Note: shard layout]'s reason for ``unpad_full`` (param.py) holds here.
        return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def fingerprint(self, fingerprint: str, description: str) -> tuple[str, str]:
        """A graph's fingerprint and description with the keep-set folded in ([Note: collective
        order check] in compile/fingerprint.py): the collectives it skips are part of its
        order."""
        if not self._digest:
            return fingerprint, description
        out = self._fingerprints.get(fingerprint)
        if out is None:
            ids = ",".join(map(str, self.nbytes))
            folded = hashlib.sha256(f"{fingerprint}|kept:{self._digest}".encode()).hexdigest()[:16]
            out = (folded, description[:-1] + f',"kept":[{ids}]}}')
            self._fingerprints[fingerprint] = out
        return out
