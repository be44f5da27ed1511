"""A plan made from the first training step, then applied for the steps after it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tensorhooks import (
    ActivationPlan,
    ActivationPlanHandle,
    PlanArgumentTypeError,
    plan_activations,
)

__all__ = ["FirstStepPlan", "check_budget"]


def check_budget(budget: object, caller: str) -> None:
    """Refuse a budget of the wrong type at the call, not at the first step.

    Its value (a fraction above 1, a string that is no size) is checked by
    `tensorhooks.plan_activations` when it plans.

    Raises:
        PlanArgumentTypeError: if ``budget`` is not an int, a float or a str.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise PlanArgumentTypeError(
            f"{caller}: budget must be bytes (an int), a fraction of the unplanned peak (a "
            f'float) or a size ("8GB", "512MiB"), or None, got {budget!r} of type '
            f"{type(budget).__name__}"
        )


class FirstStepPlan:
    """Plans a model once, from a step of its training, and keeps the plan applied.

    ``plan_and_apply(model, step)`` plans at the first call and applies the plan; `remove`
    takes it off the blocks and `apply` puts it back (the plan is made once).
    """

    __slots__ = ("_handle", "budget", "model", "plan")

    def __init__(self, budget: int | float | str, caller: str) -> None:
        check_budget(budget, caller)
        self.budget = budget
        self.plan: ActivationPlan | None = None
        self.model: nn.Module | None = None
        """The model the plan was made for."""
        self._handle: ActivationPlanHandle | None = None

    @property
    def applied(self) -> bool:
        """Whether the plan is on the blocks now."""
        return self._handle is not None

    def plan_and_apply(self, model: nn.Module, step: Callable[[], object]) -> None:
        """Plan ``model`` from ``step`` unless planned already, then apply the plan."""
        if self.plan is None:
            self.plan = plan_activations(model, step, self.budget)
            self.model = model
        self.apply()

    def apply(self) -> None:
        """Put the plan on the blocks (once planned, and unless it is on them)."""
        if self.plan is not None and self._handle is None:
            self._handle = self.plan.apply()

    def remove(self) -> None:
        """Take the plan off the blocks, if it is on them."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
