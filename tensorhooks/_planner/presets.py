"""Plans chosen by hand, priced and measured as the planner's are: what plans are compared with.

The hand choices people make today, as plans of the same model (same profile, same cost model,
same application and measurement), so a benchmark compares like with like:

- ``"keep"``: no checkpointing;
- ``"recompute"``: every block checkpointed, everything recomputed;
- ``"save matmuls"``: every block checkpointed with torch's usual selective policy, the outputs
  of matmuls saved (``mm``, ``addmm``, ``bmm``, ``baddbmm``);
- ``"offload inputs"``: every block recomputed, its inputs offloaded (accelerate's and
  DeepSpeed's checkpoint-boundary offload);
- ``"offload all"``: every block checkpointed with every output that can leave offloaded and the
  inputs too, so nothing but views and tiny tensors is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tensorhooks._core.errors import PlanArgumentValueError

from .apply import OpKey
from .costs import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    BlockCosts,
    Choice,
    choice_outcome,
    cost_table,
    plan_peak,
    plan_seconds,
)
from .plan import ActivationPlan
from .profiling import StepProfile, check_step
from .solver import Solution, block_menu, least_peak

__all__ = ["MATMULS", "PRESETS", "preset_plan"]

MATMULS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
    }
)
"""The ops whose outputs ``"save matmuls"`` keeps."""

PRESETS = ("keep", "recompute", "save matmuls", "offload inputs", "offload all")
"""The hand choices `preset_plan` knows, by name."""


def _choice(preset: str, block: BlockCosts, keys: Sequence[OpKey]) -> Choice:
    if preset == "keep":
        return KEEP
    if preset == "recompute":
        return Choice(keep=False, ops=(RECOMPUTE,) * len(keys))
    if preset == "save matmuls":
        ops = tuple(SAVE if op in MATMULS else RECOMPUTE for op, _ in keys)
        return Choice(keep=False, ops=ops)
    if preset == "offload inputs":
        return Choice(keep=False, ops=(RECOMPUTE,) * len(keys), offload_input=True)
    ops = tuple(OFFLOAD if cost.offloadable else SAVE for cost in block.ops)
    return Choice(keep=False, ops=ops, offload_input=bool(block.offloadable_input_bytes))


def preset_plan(
    model: nn.Module,
    step: Callable[[], object],
    preset: str,
    *,
    profile: StepProfile,
    bandwidth: float | None = None,
    min_offload_bytes: int = 1 << 20,
) -> ActivationPlan:
    """The plan a hand choice amounts to, for every block of ``profile``.

    Example:
        >>> import torch, tensorhooks
        >>> from tensorhooks._planner import preset_plan
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(3)))
        >>> step = lambda: model(torch.randn(8, 16)).sum().backward()
        >>> profile = tensorhooks.profile_step(model, step, rounds=1)
        >>> plan = preset_plan(model, step, "save matmuls", profile=profile)
        >>> plan.blocks[0].saved
        ('aten.addmm.default#0',)

    Args:
        model: the profiled model.
        step: its step.
        preset: one of `PRESETS`.
        profile: the profile of ``step``.
        bandwidth: the host link (default: the profile's); the offloading presets need one.
        min_offload_bytes: tensors smaller than this are never offloaded.

    Returns:
        An `ActivationPlan` whose budget is its own predicted peak.

    Raises:
        PlanArgumentValueError: if ``preset`` is unknown, or an offloading preset has no link
            (a ``ValueError``).
    """
    check_step(step, "preset_plan")
    if preset not in PRESETS:
        raise PlanArgumentValueError(
            f"preset_plan: preset must be one of {list(PRESETS)}, got {preset!r}"
        )
    link = profile.bandwidth if bandwidth is None else float(bandwidth)
    if preset.startswith("offload") and link is None:
        raise PlanArgumentValueError(
            f"preset_plan: {preset!r} offloads, and there is no host link: pass bandwidth="
        )
    table, keys = cost_table(profile, link, min_offload_bytes)
    choices = tuple(
        _choice(preset, block, block_keys)
        for block, block_keys in zip(table.blocks, keys, strict=True)
    )
    outcomes = tuple(
        choice_outcome(block, choice, link)
        for block, choice in zip(table.blocks, choices, strict=True)
    )
    solution = Solution(
        choices, outcomes, plan_peak(table, outcomes), plan_seconds(table, outcomes)
    )
    keep = [choice_outcome(block, KEEP, link) for block in table.blocks]
    return ActivationPlan(
        model=model,
        step=step,
        modules=[model.get_submodule(block.name) for block in profile.blocks],
        profile=profile,
        table=table,
        keys=keys,
        solution=solution,
        budget_bytes=solution.peak,
        least_peak_bytes=least_peak(table, [block_menu(block, link) for block in table.blocks]),
        unplanned_peak_bytes=plan_peak(table, keep),
        exact=True,
        min_offload_bytes=min_offload_bytes,
    )
