"""The integer index spaces that travel together through the plan and the step, typed apart so
that a view's number is never taken for a tensor's."""

from __future__ import annotations

from typing import NewType

# A matrix view's position in the plan (``MuonEntry``s in plan order; ``Block.view``).
ViewIndex = NewType("ViewIndex", int)
# A Muon parameter's position among the Muon parameters ("Muon tensor j").
TensorIndex = NewType("TensorIndex", int)
# A param group's position among all the optimizer's groups.
GroupIndex = NewType("GroupIndex", int)
# A stack's position among all stacks of a plan (``StackSpec.index``).
StackIndex = NewType("StackIndex", int)
