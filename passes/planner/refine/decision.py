"""What one refinement decides: the constraints the next propagation round adds.

Every refinement (:data:`tpcompile.passes.planner.refine.REFINEMENTS`) returns a
:class:`Decision` holding only what is new to the constraints it read; the planner merges a
stage's decisions with ``|`` and adds them to its :class:`Constraints` with :meth:`apply`,
the one place constraints grow. An empty decision means the refinement has nothing to add.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpcompile.passes.planner.propagate import Constraints

__all__ = ["Decision"]


@dataclass
class Decision:
    """Fields as :class:`Constraints`' (see there); each holds only what is new."""

    demands: list = field(default_factory=list)
    tied: set[str] = field(default_factory=set)
    reduce_early: set[str] = field(default_factory=set)
    cache_cuts: dict[str, object] = field(default_factory=dict)
    killed: dict[str, str] = field(default_factory=dict)   # the first reason given wins
    carried: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return any((self.demands, self.tied, self.reduce_early, self.cache_cuts, self.killed,
                    self.carried))

    def __or__(self, other: Decision) -> Decision:
        killed = dict(self.killed)
        for root, why in other.killed.items():
            killed.setdefault(root, why)
        return Decision(self.demands + other.demands, self.tied | other.tied,
                        self.reduce_early | other.reduce_early,
                        {**self.cache_cuts, **other.cache_cuts}, killed,
                        self.carried | other.carried)

    def apply(self, constraints: Constraints) -> None:
        """Add this decision to ``constraints`` (a killed root's reason is the latest one)."""
        constraints.demands.extend(self.demands)
        constraints.tied |= self.tied
        constraints.reduce_early |= self.reduce_early
        constraints.cache_cuts.update(self.cache_cuts)
        constraints.killed.update(self.killed)
        constraints.carried |= self.carried
