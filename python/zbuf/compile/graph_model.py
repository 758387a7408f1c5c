"""The small graph abstraction the planner works on, independent of FX.

A graph is its nodes in execution order (positions ``0..num_nodes-1``), a compute-time estimate
per node, and the gathers: which node produced each gathered tensor, its bytes, and the
positions of the nodes that read it. Compute nodes never move; the planner only places each
gather's start, wait and release around them. Positions of inserted ops are *slots*: slot ``i``
means "just before node ``i``".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GatherSpec", "GraphSummary"]


@dataclass(frozen=True)
class GatherSpec:
    """One gathered parameter in one graph."""

    key: str
    """Rank-invariant identity (the parameter id), used by fingerprints and reports."""

    nbytes: int
    """Bytes of the gathered (full) tensor, from ``meta["val"]``."""

    uses: tuple[int, ...]
    """Sorted positions of the nodes that read the gathered tensor (directly or through views)."""

    earliest: int
    """First slot at which its collective may start: just after the producers of its inputs."""

    escapes: bool = False
    """The gathered tensor is a graph output (kept for backward by selective persistence): it is
    never released inside this graph and stays live to the end."""

    block: str = ""
    """Coalescing key (the owning block); only gathers of the same block are coalesced."""

    pool: int = -1
    """The pool its buffer comes from (a pool id, [Note: pool ids] in runtime.py); each pool a
    graph gathers from is sized for its own gathers ([Note: pool sizing] in schedule.py)."""

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"gather {self.key!r}: nbytes={self.nbytes} < 0")
        if not self.uses:
            raise ValueError(f"gather {self.key!r} has no uses; drop it before planning")
        if list(self.uses) != sorted(set(self.uses)):
            raise ValueError(f"gather {self.key!r}: uses {self.uses} must be sorted and unique")
        if not 0 <= self.earliest <= self.uses[0]:
            raise ValueError(
                f"gather {self.key!r}: earliest slot {self.earliest} must lie in [0, first use "
                f"{self.uses[0]}]"
            )


@dataclass(frozen=True)
class GraphSummary:
    """What the planner needs to know about one graph."""

    num_nodes: int
    compute_seconds: tuple[float, ...]
    """Estimated run time of each node (cost model in graph_info.py)."""
    gathers: tuple[GatherSpec, ...]
    world_size: int | None = None
    """Ranks the gathers gather over; ``None``: unknown, priced as a collective over a link. At
    world 1 a gather is a device copy ([Note: world-aware gather cost] in schedule.py)."""

    def __post_init__(self) -> None:
        if len(self.compute_seconds) != self.num_nodes:
            raise ValueError(
                f"compute_seconds has {len(self.compute_seconds)} entries for "
                f"{self.num_nodes} nodes"
            )
        for g in self.gathers:
            if g.uses[-1] >= self.num_nodes:
                raise ValueError(f"gather {g.key!r} uses node {g.uses[-1]} >= {self.num_nodes}")
