"""A plan for the sizes each step brings: the profile scaled, solved again, before the step runs.

See NOTE [Sizes that vary between steps] in `shapes` for how the bytes grow, and
NOTE [A plan per input size] below for when a plan is made again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorhooks._core.torch_compat import below_python_modes

from .apply import OFFLOAD, SAVE, Action, OpKey
from .costs import KEEP, Choice, choice_outcome, cost_table, plan_peak
from .costs import SAVE as SAVED
from .profiles import StepProfile
from .report import mib
from .shapes import Growth, SizeModel, grown, ratios_for, signature_of
from .solver import Solution, block_menu, least_peak, solve

__all__ = ["Sizing", "actions_of", "scaled_profile"]

# NOTE [A plan per input size]
#
# A plan applied to its model watches the sizes each step brings: before the first block runs
# (from a forward pre-hook on the model, or the first block's call when the step calls the blocks
# themselves), the tensors the model is called with give the step's signature. The profile's
# signature, or any step no larger in every dimension, runs the plan as solved. A step larger in
# some dimension (a longer batch, more rows, a longer decoder input that the first dimension does
# not show) gets the profile scaled to its sizes and solved again at the same budget, before any
# block runs: no run of the step is spent, one solve is (milliseconds for a few blocks; the plans
# are kept per signature, so a size seen before costs a dictionary look-up). Where no plan fits the
# budget at those sizes, the plan warns once (`PlanBudgetWarning`), with the least peak any plan
# reaches there, and runs the plan that holds least. A step whose tensors are not the profile's
# (other paths or ranks) keeps the plan as solved, and the plan warns once that it cannot tell.
# Under FSDP2 a plan is not made again per rank (the ranks would differ): a larger step warns.

_CACHE = 256  # signatures a plan remembers


def actions_of(choices: Sequence[Choice], keys: Sequence[Sequence[OpKey]]) -> list[Action]:
    """What each block does under ``choices`` (``keys``: each block's candidate ops)."""
    actions = []
    for choice, block_keys in zip(choices, keys, strict=True):
        cached = {
            block_keys[index]: SAVE if what == SAVED else OFFLOAD
            for index, what in enumerate(choice.ops)
            if what
        }
        actions.append(Action(not choice.keep, cached, choice.offload_input))
    return actions


def _scale(figure: int, growth: Growth, ratios: Sequence[float]) -> int:
    """``figure`` grown as ``growth`` says (what was added to it by hand stays as it was)."""
    if not growth:
        return figure
    return figure + grown(growth, ratios) - grown(growth, [1.0] * len(ratios))


def _factor(before: int, after: int) -> float:
    return after / before if before else 1.0


def scaled_profile(profile: StepProfile, ratios: Sequence[float]) -> StepProfile:
    """``profile`` at the sizes ``ratios`` say (one ratio per size class, see `SizeModel`).

    Bytes as they grow; times grown with the bytes of what makes them (an op's with its outputs,
    a block's with what it saves, the step's with all it saves).
    """
    sizes = profile.sizes
    assert sizes is not None
    blocks = []
    before = after = 0
    for block, grow in zip(profile.blocks, sizes.blocks, strict=True):
        saved = _scale(block.saved_bytes, grow.saved, ratios)
        factor = _factor(block.saved_bytes, saved)
        before, after = before + block.saved_bytes, after + saved
        ops = []
        for op, (op_saved, op_other, smallest) in zip(block.ops, grow.ops, strict=True):
            new_saved = _scale(op.saved_bytes, op_saved, ratios)
            new_other = _scale(op.other_bytes, op_other, ratios)
            op_factor = _factor(op.saved_bytes + op.other_bytes, new_saved + new_other)
            ops.append(
                dataclasses.replace(
                    op,
                    saved_bytes=new_saved,
                    other_bytes=new_other,
                    smallest_output=_scale(op.smallest_output, smallest, ratios),
                    seconds=op.seconds * op_factor,
                )
            )
        inputs = tuple(
            dataclasses.replace(
                item,
                nbytes=_scale(item.nbytes, storage, ratios),
                tensor_bytes=_scale(item.tensor_bytes, tensor, ratios),
            )
            for item, (storage, tensor) in zip(block.inputs, grow.inputs, strict=True)
        )
        blocks.append(
            dataclasses.replace(
                block,
                ops=tuple(ops),
                inputs=inputs,
                input_bytes=_scale(block.input_bytes, grow.input, ratios),
                saved_bytes=saved,
                saved_and_input_bytes=_scale(
                    block.saved_and_input_bytes, grow.saved_and_input, ratios
                ),
                following_bytes=_scale(block.following_bytes, grow.following, ratios),
                forward_seconds=block.forward_seconds * factor,
                backward_seconds=block.backward_seconds * factor,
                recompute_seconds=block.recompute_seconds * factor,
            )
        )
    step = _factor(before, after)
    unplanned = profile.unplanned_step_seconds
    return dataclasses.replace(
        profile,
        blocks=tuple(blocks),
        fixed_bytes=_scale(profile.fixed_bytes, sizes.fixed, ratios),
        after_bytes=_scale(profile.after_bytes, sizes.after, ratios),
        after_forward_seconds=profile.after_forward_seconds * step,
        after_backward_seconds=profile.after_backward_seconds * step,
        checkpointed_step_seconds=profile.checkpointed_step_seconds * step,
        unplanned_step_seconds=None if unplanned is None else unplanned * step,
        checkpointed_peak_bytes=round(profile.checkpointed_peak_bytes * step),
        unplanned_peak_bytes=None,
    )


class Sizing:
    """The plans of one `ActivationPlan` per input size (see NOTE [A plan per input size]).

    Args:
        profile: the plan's profile (its ``sizes`` say how its bytes grow).
        solution: the plan as solved for the profile.
        keys: each block's candidate ops.
        budget: the plan's budget in bytes.
        link: the host link the plan was solved for.
        min_offload_bytes: the plan's threshold.
        warn: warns once per kind (the plan's).
    """

    def __init__(
        self,
        profile: StepProfile,
        solution: Solution,
        keys: Sequence[Sequence[OpKey]],
        *,
        budget: int,
        link: float | None,
        min_offload_bytes: int,
        warn: Callable[[str, str], None],
    ) -> None:
        self.profile = profile
        self.model: SizeModel | None = profile.sizes
        self.keys = [list(block_keys) for block_keys in keys]
        self.budget = budget
        self.link = link
        self.min_offload_bytes = min_offload_bytes
        self.warn = warn
        self.base = actions_of(solution.choices, self.keys)
        self.plans: dict[tuple[float, ...], list[Action]] = {}
        self.last: tuple[Any, ...] | None = None
        self.last_actions = self.base
        self.replans = 0

    def actions(self, args: Any, kwargs: Any) -> list[Action]:
        """What each block does in a step called with ``args`` and ``kwargs``."""
        signature = signature_of(args, kwargs)
        if signature == self.last:
            return self.last_actions
        self.last = signature
        self.last_actions = self._for(signature)
        return self.last_actions

    def _for(self, signature: tuple[Any, ...]) -> list[Action]:
        model = self.model
        if model is None or signature == model.signature:
            return self.base
        ratios = ratios_for(model, signature)
        if ratios is None:
            self.warn(
                "signature",
                f"the model is called with tensors unlike the profiled step's "
                f"({_shapes(signature)} against {_shapes(model.signature)}), so the plan cannot "
                "tell their sizes and "
                "runs as it was solved; profile a step called like this one",
            )
            return self.base
        if all(ratio <= 1.0 for ratio in ratios):
            return self.base
        found = self.plans.get(ratios)
        if found is None:
            with torch.no_grad(), below_python_modes():
                found = self._solved(ratios, signature)
            if len(self.plans) >= _CACHE:
                self.plans.pop(next(iter(self.plans)))
            self.plans[ratios] = found
            self.replans += 1
        return found

    def _solved(self, ratios: tuple[float, ...], signature: tuple[Any, ...]) -> list[Action]:
        profile = scaled_profile(self.profile, ratios)
        table, keys = cost_table(profile, self.link, self.min_offload_bytes)
        assert [list(block) for block in keys] == self.keys
        menus = [block_menu(block, self.link) for block in table.blocks]
        least = least_peak(table, menus)
        budget = self.budget
        if least > budget:
            unplanned = plan_peak(
                table, [choice_outcome(block, KEEP, self.link) for block in table.blocks]
            )
            self.warn(
                "sizes",
                f"a step called with {_shapes(signature)} needs at least {least} bytes "
                f"({mib(least)}) of saved activations under any plan (unplanned: "
                f"{mib(unplanned)}), above the budget of {budget} bytes ({mib(budget)}); it runs "
                "the plan that holds the least. Plan with a budget for the largest batch, or "
                "make the batches smaller",
            )
            budget = least
        solution = solve(table, menus, budget)
        assert solution is not None
        return actions_of(solution.choices, self.keys)


def _shapes(signature: tuple[Any, ...]) -> str:
    shown = ", ".join(f"{path} {list(shape)}" for path, shape in signature[:4])
    return shown + (", ..." if len(signature) > 4 else "")
