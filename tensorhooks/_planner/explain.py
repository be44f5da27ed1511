"""explain: what holds a step's peak of saved activations, the traps in it, and the plan that fits.

The step runs once as the user runs it, traced (`tracing`, see
NOTE [Tracing a step as the user runs it]); its holds are replayed to the peak (`timeline`);
the lints look for the known traps (`lints`); with a budget, `plan_activations` finds the
cheapest plan under it. `explained` puts it in words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch import nn

from tensorhooks._core.errors import PlanBudgetError

from .accounting import HOST
from .blocks import repeated_stacks, resolve_blocks
from .checks import budget_in_bytes, untouched
from .explained import Explanation, HeldTensor
from .layers import hf_checkpointing_on
from .lints import LintInputs, find_lints
from .plan import ActivationPlan, plan_activations
from .profiling import StepProfile, check_step
from .ranks import largest
from .timeline import finish, replay
from .tracing import Interval, Trace, display_name, traced

__all__ = ["explain"]

_OUTSIDE = "(outside the model)"


def _block_of(name: str, blocks: Sequence[str]) -> int:
    """The index of the block ``name`` is in, or ``len(blocks)``."""
    for index, block in enumerate(blocks):
        if name == block or name.startswith(block + "."):
            return index
    return len(blocks)


def _held(trace: Trace, interval: Interval, blocks: Sequence[str]) -> HeldTensor:
    site = interval.site
    calls, ops = trace.calls, trace.ops
    module = calls[site.call].name if site.call >= 0 else _OUTSIDE
    maker = ops[site.maker] if site.maker >= 0 else None
    index = _block_of(module, blocks)
    end = max(trace.end, 1)
    return HeldTensor(
        module=module,
        op="(input)" if maker is None else maker.name,
        made_in=_OUTSIDE if maker is None or maker.call < 0 else calls[maker.call].name,
        status="offloaded" if interval.where == HOST else site.status,
        how=site.how,
        nbytes=interval.nbytes,
        block=blocks[index] if index < len(blocks) else None,
        saved_at=min(interval.start / end, 1.0),
        freed_at=1.0 if interval.end is None else min(interval.end / end, 1.0),
    )


def _device(model: nn.Module) -> str:
    """Where the model computes: the first accelerator a parameter or buffer is on, or the CPU."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "cpu":
            return str(tensor.device)
    return "cpu"


def _layers(model: nn.Module) -> dict[str, str]:
    names = {id(module): display_name(name) for name, module in model.named_modules()}
    return {
        names[id(member)]: type(member).__name__
        for stack in repeated_stacks(model)
        for member in stack
    }


def _cheapest(
    model: nn.Module,
    step: Callable[[], object],
    budget: int,
    regions: dict[int, int],
    options: dict[str, object],
) -> tuple[ActivationPlan | None, str | None]:
    """The fastest plan under ``budget``, or why there is none."""
    if options["profile"] is None and (regions or hf_checkpointing_on([model])):
        return None, (
            f"no plan: the step checkpoints by itself ({len(regions)} checkpointed regions "
            "seen), and the planner plans a model that does not; turn that checkpointing off "
            "(model.gradient_checkpointing_disable(), or leave the layers unwrapped) and "
            "explain again, or pass profile=tensorhooks.profile_step(...) of the model without it."
        )
    try:
        plan = plan_activations(model, step, budget, **options)  # type: ignore[arg-type]
    except PlanBudgetError as error:
        return None, f"no plan: {error}"
    return plan, None


def explain(
    model: nn.Module,
    step: Callable[[], object],
    budget: int | float | str | None = None,
    *,
    blocks: Sequence[nn.Module] | None = None,
    profile: StepProfile | None = None,
    bandwidth: float | None = None,
    min_offload_bytes: int = 1 << 20,
) -> Explanation:
    """Say what holds the step's peak of saved activations, the traps in it, and what would fit.

    ``step`` runs once as it is, with whatever checkpointing, offloading and saved-tensor hooks
    it uses, under hooks that see every tensor autograd saves: which module saved it, which op
    made it, whether it is kept, recomputed or offloaded, and from when to when it is held. The
    peak is counted as `ActivationPlan.measured_peak_bytes` counts it (distinct storages,
    parameters left out). Known traps are looked for (see `Lint`): checkpoints around a layer's
    children instead of the layer, a selective policy that keeps nothing or everything, a
    checkpoint whose inputs outweigh what it saves, a KV cache under checkpointing, saved-tensor
    hooks that return what they are given. With a ``budget``, `plan_activations` finds the
    cheapest plan under it (profiling the step), and the explanation says what it costs in time.

    Example:
        >>> import torch, tensorhooks
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(3)))
        >>> x = torch.randn(8, 16)
        >>> step = lambda: model(x).sum().backward()
        >>> explanation = tensorhooks.explain(model, step)
        >>> explanation.attributed_fraction
        1.0
        >>> explanation.rows()[0].op   # the largest: GELU's input, kept by GELU and the Linear
        'addmm'

    Args:
        model: the model ``step`` trains.
        step: runs one forward and backward the way training does (no optimizer step). The
            parameters' ``.grad``, the buffers and the RNG states are put back as they were.
        budget: bytes (an int), a fraction in (0, 1] of the peak measured here (the step as it
            runs; under FSDP2 the largest over the ranks; a float), or a size with units
            (``"8GB"``, ``"512MiB"``); None: no plan.
        blocks: the blocks to group by and plan; default: the layers of every stack of
            repeated layers, as `plan_activations` takes them.
        profile: a `StepProfile` of the model without checkpointing of its own, to plan from.
        bandwidth: host↔device bytes per second to plan offloading for (see
            `plan_activations`).
        min_offload_bytes: tensors smaller than this are never offloaded by the plan.

    Returns:
        An `Explanation` (``print`` it; ``save_chart`` draws it).

    Raises:
        PlanArgumentTypeError: if ``model`` is not an ``nn.Module``, ``step`` is not callable,
            or ``budget`` has the wrong type (a ``TypeError``).
        PlanArgumentValueError: if ``budget`` is not positive, a float above 1, or a string that
            is not a size, or the blocks are not distinct submodules (a ``ValueError``).
        PlanStateError: if the step changes a parameter in place (an optimizer step), or, when
            planning, what `plan_activations` refuses (a ``RuntimeError``).
    """
    check_step(step, "explain")
    named = resolve_blocks(model, blocks, "explain")
    if budget is not None:
        budget_in_bytes(budget, 1, "explain")  # its type and form, before the step runs
    block_names = [display_name(name) for name, _ in named]
    with untouched(model, "explain"):
        trace = traced(model, step)
    regions = finish(trace)
    part_of: dict[int, int] = {}

    def part(interval: Interval) -> int:
        call = interval.site.call
        if call not in part_of:
            name = trace.calls[call].name if call >= 0 else _OUTSIDE
            part_of[call] = _block_of(name, block_names)
        return part_of[call]

    replayed = replay(trace, len(block_names) + 1, part)
    held = sorted(
        (_held(trace, interval, block_names) for interval in replayed.live),
        key=lambda tensor: (tensor.status == "offloaded", -tensor.nbytes, tensor.module),
    )
    first_backward = next((op.tick for op in trace.ops if op.backward), trace.end)
    end = max(trace.end, 1)
    layers = _layers(model)
    lints = find_lints(LintInputs(trace, regions, layers, held, replayed.peak))
    explanation = Explanation(
        device=_device(model),
        peak_bytes=replayed.peak,
        host_peak_bytes=replayed.host_peak,
        peak_at=replayed.peak_tick / end,
        peak_in_backward=replayed.peak_tick >= first_backward,
        backward_at=first_backward / end,
        held=tuple(held),
        attributed_bytes=sum(
            tensor.nbytes
            for tensor in held
            if tensor.status != "offloaded"
            and (tensor.module != _OUTSIDE or tensor.op != "(input)")
        ),
        blocks=tuple(block_names),
        layers=tuple(layers),
        lints=tuple(lints),
        timeline=tuple(
            (tick / end, parts) for tick, parts in zip(replayed.ticks, replayed.parts, strict=True)
        ),
    )
    if budget is None:
        return explanation
    options: dict[str, object] = {
        "blocks": blocks,
        "profile": profile,
        "bandwidth": bandwidth,
        "min_offload_bytes": min_offload_bytes,
    }
    return _with_plan(explanation, model, step, budget, regions=regions, options=options)


def _with_plan(
    explanation: Explanation,
    model: nn.Module,
    step: Callable[[], object],
    budget: int | float | str,
    *,
    regions: dict[int, int],
    options: dict[str, object],
) -> Explanation:
    """``explanation`` with the cheapest plan under ``budget``, or why there is none.

    A fractional budget is a fraction of the peak measured here, the step as it runs; under
    FSDP2 of the largest over the ranks, so that they all plan for one budget (a collective).
    """
    reference = largest(explanation.peak_bytes, model)
    budget_bytes = budget_in_bytes(budget, reference, "explain")
    plan, note = _cheapest(model, step, budget_bytes, regions, options)
    given = options["profile"]
    used = plan.profile if plan is not None else given if isinstance(given, StepProfile) else None
    return dataclasses.replace(
        explanation,
        budget_bytes=budget_bytes,
        plan=plan,
        plan_note=note,
        unplanned_step_seconds=None if used is None else used.unplanned_step_seconds,
        checkpointed_step_seconds=None if used is None else used.checkpointed_step_seconds,
    )
