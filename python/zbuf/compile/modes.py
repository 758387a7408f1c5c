"""Which of ``zbuf.compile``'s modes combine: one table that ``zbuf.compile``, the backend's
options and ``zbuf train`` all read.

[Note: one table of modes]
A mode switches what zbuf does with the step (``structure``, ``recompute``,
``optimizer_in_backward``, ``offload_optimizer``); a few knobs only mean
something under some modes (an explicit ``budget_bytes``, ``activation_budget_bytes``, the
``coalesce`` options) or need something of the caller (``optimizer=``, ``fullgraph=True``).
``RULES`` lists every combination zbuf refuses, each with the one line that says why and what to
do instead; whatever no rule refuses is legal (``legal_modes`` lists the legal combinations of
the modes, which tests/test_modes.py runs one by one, and tests/gpu/test_modes_gpu.py on CUDA).
No option is silently ignored: a knob a mode does not read is refused under it. Each caller spells the options its own way
(``API_SPELLING`` for ``zbuf.compile``, the command's flags in zbuf/train/config.py), so a
refusal names what the user typed.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping, NamedTuple, Optional

__all__ = ["Modes", "Rule", "RULES", "API_SPELLING", "refusal", "legal_modes"]


class Modes(NamedTuple):
    """What one compile asks for. ``structure`` None: not chosen yet (zbuf picks, [Note: one
    path] in compiled_model.py); the knobs are whether they are set."""

    structure: Optional[str] = None
    """``"graph"``, ``"blocks"`` or None."""
    recompute: str = "checkpointed"
    """``"checkpointed"``, ``"auto"`` or ``"none"``."""
    optimizer_in_backward: bool = False
    offload_optimizer: bool = False
    budget_bytes: bool = False
    """An explicit gather budget."""
    activation_budget_bytes: bool = False
    """An explicit cap on the whole graph's activations."""
    coalesce: bool = False
    """A coalesce option away from its default."""
    optimizer: bool = True
    """``optimizer=`` given (True where the caller cannot tell: the backend's options)."""
    fullgraph: bool = True
    """``fullgraph=True`` (True where the caller cannot tell)."""


Spelling = Mapping[str, Callable[[str], str]]
"""Option name -> how a caller writes it with a value (the value as the template gives it)."""


def _setting(name: str) -> Callable[[str], str]:
    return lambda value: f"{name}={value}" if value else name


API_SPELLING: Spelling = {
    name: _setting(name) for name in Modes._fields if name not in ("optimizer", "coalesce")
} | {"optimizer": lambda value: "optimizer=",
     "coalesce": lambda value: "coalesce / coalesce_max_bytes / coalesce_min_bytes"}
"""How ``zbuf.compile`` and ``CompileOptions`` write the options: ``structure='blocks'``."""


class _Spelled:
    """A template's ``{name}`` (the option as set) or ``{name:value}`` (the option at that
    value), in one caller's spelling."""

    def __init__(self, spelling: Spelling, modes: Modes, name: str) -> None:
        self.spelling, self.modes, self.name = spelling, modes, name

    def __format__(self, value: str) -> str:
        if not value:
            current = getattr(self.modes, self.name)
            value = repr(current) if isinstance(current, str) else ""
        return self.spelling[self.name](value)


class Rule(NamedTuple):
    """One refused combination."""

    refuses: Callable[[Modes], bool]
    line: str
    """Why, and the fix: a ``str.format`` template over the option names ([Note: one table of
    modes])."""

    def render(self, modes: Modes, spelling: Spelling) -> str:
        return self.line.format_map({n: _Spelled(spelling, modes, n) for n in Modes._fields})


def _blocks(m: Modes) -> bool:
    return m.structure == "blocks"


RULES: tuple[Rule, ...] = (
    Rule(lambda m: m.offload_optimizer and not m.optimizer,
         "{offload_optimizer:True} moves the state of the optimizer it is given: pass "
         "{optimizer}"),
    Rule(lambda m: m.optimizer_in_backward and not m.optimizer,
         "{optimizer_in_backward:True} needs {optimizer}: the optimizer is what backward steps"),
    Rule(lambda m: m.optimizer_in_backward and not m.fullgraph,
         "{optimizer_in_backward:True} needs {fullgraph:True}: one graph must make each gradient "
         "(a graph break could split a parameter's uses and step it twice)"),
    Rule(lambda m: m.activation_budget_bytes and m.recompute != "auto",
         "{activation_budget_bytes} is the budget of {recompute:'auto'}; with {recompute} "
         "nothing plans against it"),
    Rule(lambda m: _blocks(m) and m.recompute == "auto" and m.budget_bytes,
         "{structure:'blocks'} with {recompute:'auto'} plans the blocks' levels in the room the "
         "first step measures, and {budget_bytes} is never measured: drop {budget_bytes}, or use "
         "{recompute:'checkpointed'}"),
    Rule(lambda m: _blocks(m) and m.activation_budget_bytes,
         "{structure:'blocks'} does not take {activation_budget_bytes} (a cap on the whole "
         "graph's activation peak; the blocks' levels are planned in the measured room): leave "
         "it unset, or use {structure:'graph'}"),
    Rule(lambda m: _blocks(m) and m.optimizer_in_backward,
         "{structure:'blocks'} does not take {optimizer_in_backward:True} (its gradients are "
         "reduced by the eager runtime, not a backward graph): use {structure:'graph'}"),
    Rule(lambda m: _blocks(m) and m.coalesce,
         "{structure:'blocks'} gathers each block with one collective, so {coalesce} would tune "
         "nothing: leave them unset, or use {structure:'graph'}"),
)


def refusal(modes: Modes, spelling: Spelling = API_SPELLING) -> Optional[str]:
    """The line of the first rule that refuses ``modes`` (None: legal)."""
    for rule in RULES:
        if rule.refuses(modes):
            return rule.render(modes, spelling)
    return None


def legal_modes() -> list[Modes]:
    """Every legal combination of the modes (structure chosen; the knobs unset)."""
    every = itertools.product(("graph", "blocks"), ("checkpointed", "auto", "none"),
                              (False, True), (False, True))
    return [m for m in (Modes(*combo) for combo in every) if refusal(m) is None]
