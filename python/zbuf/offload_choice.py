"""Whether the optimizer's state lives on the device or in host memory: the user's word, or the
memory plan's when the user left it open (``zbuf.compile(..., offload_optimizer=None)``).

[Note: offloading when the step does not fit]
A user asks whether a model trains on a card; whether AdamW's moments must leave the card for it
is zbuf's to know, not a flag the user must find. The moments are made by the first ``step()``
and from then on held through every forward and backward, so what decides is step 0 itself,
measured ([Note: measure first, then spend] in zbuf/step_memory.py): at its optimizer step's
pre-hook, before any state exists, the step's largest forward or backward peak (torch's
reserved bytes plus what the pool held) is known on every rank, agreed as the largest, against
the smallest usable limit. If that peak plus the whole state fits, nothing changes. If not, the
state is offloaded ([Note: optimizer state offloaded after backward] in
zbuf/optimizer_step_offload.py), keeping on the device what fits beside the peak and the two
slots the streamed part passes through (``resident_state_bytes``): the less moved, the less
exposed. Decided there, it is decided for the run, on every rank alike, before the state
exists, so nothing has to move afterwards; the measured step's decision ([Note: whole-step
budget]) then sees only the state that stayed as the step's growth.

One case is known before step 0: when the whole state plus the gradients and the optimizer's
temporaries exceed the free memory agreed at compile time, step 0 could not reach its optimizer
step with that state reserved; then the state is offloaded whole from the start
(``compile_time``).

The record says which it was (``report``): chosen by the user or by the plan, and why, in bytes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .optimizer_policy import OptimizerPolicy
from .optimizer_step_offload import BUCKET_BYTES, SLOTS, StepOffload

__all__ = ["OffloadChoice", "resident_state_bytes", "slot_estimate_bytes"]


def slot_estimate_bytes(optimizer: torch.optim.Optimizer,
                        bucket_bytes: int = BUCKET_BYTES) -> int:
    """Device bytes the streamed state's slots take at most: ``SLOTS`` buckets, each closed by
    the parameter that reaches ``bucket_bytes`` (so at most that plus the largest parameter's
    state), and never more than the whole state."""
    policy = OptimizerPolicy.of(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    largest = max((policy.state_bytes([p]) for p in params), default=0)
    return min(policy.state_bytes(params), SLOTS * (bucket_bytes + largest))


def resident_state_bytes(usable_bytes: int, peak_bytes: int, state_bytes: int,
                         slot_bytes: int) -> Optional[int]:
    """None when the whole state fits beside the step's peak; else the state that stays on the
    device beside the peak and the slots ([Note: offloading when the step does not fit])."""
    if peak_bytes + state_bytes <= usable_bytes:
        return None
    return max(0, min(state_bytes, usable_bytes - peak_bytes - slot_bytes))


class OffloadChoice:
    """The optimizer's state placement for one ``zbuf.compile``: ``mode`` True (the user's: all
    of it offloaded), or None (the plan's: ``compile_time`` or, at step 0, ``decide``).
    ``install`` puts the offload's hooks on the optimizer; call it after the step's memory owner
    has put its own, so that at each step its decision runs before the offload's work."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 mode: Optional[bool]) -> None:
        self.optimizer = optimizer
        self.device = device
        self.mode = mode
        self.offload: Optional[StepOffload] = None
        self.chosen_by: Optional[str] = "user" if mode else None
        """"user", "plan", or None (undecided, or decided to keep the state on the device)."""
        self.why: Optional[str] = "offload_optimizer=True" if mode else None
        self.decided = bool(mode)
        self.measured: Optional[dict[str, int]] = None
        """Step 0's numbers the plan decided on."""

    @property
    def pending(self) -> bool:
        """The plan still has to decide at step 0."""
        return not self.decided

    @property
    def offloaded(self) -> bool:
        return self.chosen_by is not None

    def install(self) -> StepOffload:
        self.offload = StepOffload(self.optimizer, self.device, bucket_bytes=BUCKET_BYTES,
                                   active=self.offloaded)
        return self.offload

    def compile_time(self, free_bytes: int, need_bytes: int) -> None:
        """Offload the whole state from the start: with it reserved, the agreed free memory
        ``free_bytes`` cannot hold the gradients and the step's temporaries ``need_bytes``."""
        self.chosen_by, self.decided = "plan", True
        self.why = (f"at compile time the agreed free memory beside the optimizer's state "
                    f"({_gib(free_bytes)}) could not hold the gradients and the step's "
                    f"temporaries ({_gib(need_bytes)}): all of the state in host memory")

    def decide(self, usable_bytes: int, peak_bytes: int) -> None:
        """At step 0's optimizer step, before the state exists: ``peak_bytes`` is the step's
        rank-agreed largest forward or backward peak, ``usable_bytes`` the limit less the
        margin ([Note: offloading when the step does not fit])."""
        self.decided = True
        policy = OptimizerPolicy.of(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = policy.state_bytes(params)
        resident = resident_state_bytes(usable_bytes, peak_bytes, state,
                                        slot_estimate_bytes(self.optimizer, BUCKET_BYTES))
        self.measured = {"usable_bytes": usable_bytes, "peak_bytes": peak_bytes,
                         "state_bytes": state}
        if resident is None:
            return
        self.offload.activate(resident)
        self.chosen_by = "plan"
        self.why = (f"step 0 peaked at {_gib(peak_bytes)}; with the optimizer's {_gib(state)} "
                    f"of state beside it the step needs {_gib(peak_bytes + state)}, over the "
                    f"usable {_gib(usable_bytes)}: {_gib(self.offload.resident_bytes)} of the "
                    f"state stays on the device, the rest in host memory")

    def report(self) -> dict[str, Any]:
        """For the run record: who chose, why, and what the offload moved."""
        out = {"mode": "auto" if self.mode is None else "on", "chosen_by": self.chosen_by,
               "why": self.why, "measured": self.measured}
        if self.offload is not None:
            out.update(self.offload.report())
        return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
