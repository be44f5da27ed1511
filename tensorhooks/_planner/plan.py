"""plan_activations: keep, recompute or offload, chosen per block and op under a memory budget."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorhooks._core.errors import (
    PlanArgumentTypeError,
    PlanArgumentValueError,
    PlanBudgetError,
    PlanStateError,
)
from tensorhooks._core.torch_compat import current_graph_task_id, fsdp_meshes

from .accounting import DEVICE, HOST, HeldBytes, holding_hooks, module_keys
from .apply import Application, OpKey, Warned
from .blocks import repeated_stacks, resolve_blocks
from .checks import budget_in_bytes, check_model_state, untouched
from .costs import KEEP, Choice, CostTable, choice_outcome, cost_table, plan_peak
from .costs import OFFLOAD as OFFLOADED
from .costs import SAVE as SAVED
from .profiling import StepProfile, check_step, profile_step
from .recording import StepClock, device_of
from .report import BlockPlan, PlanReport, mib, plan_table
from .sizing import Sizing
from .solver import Solution, block_menu, least_peak, solve

__all__ = ["ActivationPlan", "ActivationPlanHandle", "plan_activations"]

_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20

# NOTE [The confirming step]
#
# The cost model counts bytes as the measurement does, from what the recorded step saved, so a
# plan's predicted peak is what its step holds. Planning that profiled the step itself checks
# it once all the same: it runs the step under the plan (the model, its `.grad`, buffers and
# random states left as they were, as after profiling) and keeps the measured peak on the plan.
# Should the step hold more than the budget (it saved what the recorded step did not), the
# excess is added to the profile's fixed bytes and the plan solved again, and measured again;
# what still exceeds is warned of (`PlanBudgetWarning`) rather than left unsaid. The step's time
# anchors the predicted times too: the recorded step's is estimated (what recording cost is taken
# off it), this one is measured, so every predicted time is moved by the difference (the choices
# only depend on differences between them). It is one run of the step, so planning costs one
# recorded and one planned step.

_FSDP_SIZES = (
    "plan_activations: a step is larger than the profiled one; under FSDP2 the plan is not "
    "solved again for it (the ranks would plan apart), so it may hold more than the budget: "
    "profile the largest batch"
)

NO_STACKS = (
    "no repeated blocks found (no ModuleList or Sequential of two or more layers of one class), "
    "so the model's children are the blocks; pass blocks=[...] with the layers to plan"
)


def _op_name(key: OpKey) -> str:
    op, call = key
    return f"{op}#{call}"


class ActivationPlanHandle:
    """A plan applied to its model's blocks, until `remove` (or the end of a ``with`` block).

    Example:
        >>> import torch, tensorhooks
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(3)))
        >>> x = torch.randn(8, 16)
        >>> step = lambda: model(x).sum().backward()
        >>> plan = tensorhooks.plan_activations(model, step, budget=0.7)
        >>> handle = plan.apply()
        >>> step()                    # blocks run as the plan says
        >>> handle.remove()

    Nesting and threads: the blocks run as the plan says on every thread until ``remove()``;
    one plan at a time may be applied to a block. ``with handle:`` removes it on exit.
    """

    def __init__(self, application: Application, held: HeldBytes | None) -> None:
        self._application = application
        self._held = held
        self._removed = False

    @property
    def measured_peak_bytes(self) -> int | None:
        """The peak of device bytes held for backward so far (with ``measure=True``), or None."""
        return None if self._held is None else self._held.peak[DEVICE]

    @property
    def measured_host_peak_bytes(self) -> int | None:
        """The peak of offloaded bytes so far (with ``measure=True``), or None."""
        return None if self._held is None else self._held.peak[HOST]

    def remove(self) -> None:
        """Give each block its own ``forward`` back.

        Raises:
            PlanStateError: if the handle was already removed (a ``RuntimeError``).
        """
        if self._removed:
            raise PlanStateError(
                "ActivationPlanHandle.remove: this handle was already removed; apply the plan "
                "again (plan.apply()) to get a new one"
            )
        self._removed = True
        self._application.remove()

    def __enter__(self) -> ActivationPlanHandle:
        if self._removed:
            raise PlanStateError(
                "ActivationPlanHandle: this handle was already removed, so `with handle:` would "
                "run its body unplanned; apply the plan again (with plan.apply(): ...)"
            )
        return self

    def __exit__(self, *args: object) -> None:
        self.remove()


class ActivationPlan:
    """What `plan_activations` chose for each block, with its predicted peak and step time.

    ``with plan:`` runs the body with the plan applied and measures what autograd holds (for
    `report`); `apply` applies it until its handle is removed, for a training loop. ``str(plan)``
    is a table: per block what is kept, recomputed and offloaded, and what it holds.

    Example:
        >>> import torch, tensorhooks
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(4)))
        >>> x = torch.randn(8, 16)
        >>> step = lambda: model(x).sum().backward()
        >>> plan = tensorhooks.plan_activations(model, step, budget=0.5)
        >>> plan.blocks[-1].choice   # its backward comes first: recomputing it rarely helps
        'keep'
        >>> with plan:
        ...     step()
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True

    A step called with larger inputs than the profiled one (more rows, longer sequences, in
    any tensor the model is called with) is planned for again before it runs, from the profile
    scaled to its sizes (``plan.replans`` counts them); one no plan fits, or one measured above
    the budget under ``with plan:``, is warned of once (`PlanBudgetWarning`).

    Nesting and threads: a plan replaces its blocks' ``forward`` (and, to see the step's input
    sizes, its model's) for every thread while it is applied, and one plan at a time may be
    applied to a block. ``with plan:`` also pushes a pair of saved-tensor hooks on the entering
    thread (to measure), so run the planned step on that thread; plans do not nest.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        step: Callable[[], object],
        modules: Sequence[nn.Module],
        profile: StepProfile,
        table: CostTable,
        keys: Sequence[Sequence[OpKey]],
        solution: Solution,
        budget_bytes: int,
        least_peak_bytes: int,
        unplanned_peak_bytes: int,
        exact: bool,
        min_offload_bytes: int,
        note: str | None = None,
    ) -> None:
        self._model = model
        self._step = step
        self._modules = list(modules)
        self._keys = [list(block_keys) for block_keys in keys]
        self._min_offload_bytes = min_offload_bytes
        self.profile = profile
        """The `StepProfile` the plan was made from."""
        self.table = table
        self.budget_bytes = budget_bytes
        """The budget, in bytes."""
        self.least_peak_bytes = least_peak_bytes
        """The least peak any plan of the cost model reaches."""
        self.unplanned_peak_bytes = unplanned_peak_bytes
        """The predicted peak with no plan (every block kept): what a fractional budget scales."""
        self.exact = exact
        """False where a block had more policies than the solver searches one by one."""
        self.note = note
        """What the plan warns of, such as no repeated blocks found, or None."""
        self._solution = solution
        self._warned = Warned()
        self._sized: Sizing | None = None
        self._quiet = False
        self.choices = solution.choices
        self.predicted_peak_bytes = solution.peak
        """The predicted peak of device bytes held for backward."""
        self.predicted_step_seconds = solution.seconds
        """The predicted step time."""
        self.blocks = tuple(
            self._block_plan(index, choice) for index, choice in enumerate(solution.choices)
        )
        """One `BlockPlan` per block, in forward order."""
        self.measured_peak_bytes: int | None = None
        """The device peak measured by the last ``with plan:`` block, or None."""
        self.measured_host_peak_bytes: int | None = None
        """The host peak measured by the last ``with plan:`` block, or None."""
        self._entered: tuple[ActivationPlanHandle, HeldBytes, object] | None = None

    @property
    def predicted_host_bytes(self) -> int:
        """Bytes the plan keeps in host memory at the end of the forward pass."""
        return sum(block.host_bytes for block in self.blocks)

    def _block_plan(self, index: int, choice: Choice) -> BlockPlan:
        block = self.table.blocks[index]
        outcome = choice_outcome(block, choice, self.table.bandwidth)
        keys = self._keys[index]
        profiled = self.profile.blocks[index]
        cached = sum(1 for what in choice.ops if what)
        return BlockPlan(
            name=profiled.name,
            checkpoint=not choice.keep,
            saved=tuple(_op_name(keys[i]) for i, what in enumerate(choice.ops) if what == SAVED),
            offloaded=tuple(
                _op_name(keys[i]) for i, what in enumerate(choice.ops) if what == OFFLOADED
            ),
            offload_input=choice.offload_input,
            recomputed=0 if choice.keep else profiled.recompute_ops - cached,
            device_bytes=outcome.device,
            backward_bytes=outcome.backward,
            host_bytes=outcome.host,
            seconds=outcome.seconds,
        )

    def _sizing(self) -> Sizing:
        if self._sized is None:
            self._sized = Sizing(
                self.profile,
                self._solution,
                self._keys,
                budget=self.budget_bytes,
                link=self.table.bandwidth,
                min_offload_bytes=self._min_offload_bytes,
                warn=self._warned.once,
            )
        return self._sized

    @property
    def replans(self) -> int:
        """How many input sizes larger than the profiled ones the plan was solved again for.

        See docs/planner.md, "Batches of other sizes": each is solved once, before its first
        step runs, from the profile scaled to its sizes.
        """
        return 0 if self._sized is None else self._sized.replans

    def apply(self, *, measure: bool = False) -> ActivationPlanHandle:
        """Apply the plan to its blocks until the returned handle's ``remove()``.

        Args:
            measure: count what autograd holds in the blocks (the handle's
                ``measured_peak_bytes``; what is saved outside the blocks is counted only under
                ``with plan:``). Off by default: it costs a little per saved tensor.

        Returns:
            An `ActivationPlanHandle`.

        Raises:
            PlanStateError: if a block already runs under a plan (a ``RuntimeError``).
        """
        held = HeldBytes(module_keys(self._model)) if measure else None
        sizing = self._sizing()
        application = Application(
            self._modules,
            sizing.base,
            held=held,
            min_offload_bytes=self._min_offload_bytes,
            warnings=self._warned,
        )
        self._watch_sizes(application, sizing)
        application.install()
        return ActivationPlanHandle(application, held)

    def _watch_sizes(self, application: Application, sizing: Sizing) -> None:
        """Solve the plan again for larger steps (see NOTE [A plan per input size])."""
        sizes = self.profile.sizes
        if sizes is None:
            return
        sharded = bool(fsdp_meshes(self._model))

        def resize(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled() or current_graph_task_id() != -1:
                return
            actions = sizing.actions(args, kwargs)
            if not sharded:
                application.set_actions(actions)
            elif actions is not sizing.base:
                self._warned.once("fsdp", _FSDP_SIZES)

        if sizes.source == "block":

            def first(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                if index == 0:
                    resize(args, kwargs)

            application.on_call = first
        else:
            application.root = self._model
            application.on_root_call = resize

    def __enter__(self) -> ActivationPlan:
        if self._entered is not None:
            raise PlanStateError(
                "ActivationPlan: the plan is already entered; plans do not nest (exit it first)"
            )
        handle = self.apply(measure=True)
        held = handle._held
        assert held is not None
        hooks = holding_hooks(held)
        try:
            hooks.__enter__()
        except BaseException:
            handle.remove()
            raise
        self._entered = (handle, held, hooks)
        return self

    def _confirm(self) -> int:
        """Run the step once under the plan, the model left as it was; its measured peak.

        See NOTE [The confirming step]. Sets ``measured_peak_bytes``, and the predicted step
        times to what the step took (every other figure moved by as much); warns of nothing.
        """
        clock = StepClock(device_of(self._model, self.profile.device))
        self._quiet = True
        try:
            with untouched(self._model, "plan_activations"), self:
                seconds = clock.time(self._step)
        finally:
            self._quiet = False
        self._anchor(seconds - self.predicted_step_seconds)
        assert self.measured_peak_bytes is not None
        return self.measured_peak_bytes

    def _anchor(self, shift: float) -> None:
        """Move every predicted step time by ``shift`` seconds (the choices are unchanged)."""
        profile = self.profile
        unplanned = profile.unplanned_step_seconds
        self.profile = dataclasses.replace(
            profile,
            checkpointed_step_seconds=max(0.0, profile.checkpointed_step_seconds + shift),
            unplanned_step_seconds=None if unplanned is None else max(0.0, unplanned + shift),
        )
        self.predicted_step_seconds = max(0.0, self.predicted_step_seconds + shift)

    def _warn_if_over(self) -> None:
        """Warn once if the last measured peak is above the budget."""
        measured = self.measured_peak_bytes
        if measured is not None and measured > self.budget_bytes:
            self._warned.once(
                "measured",
                f"plan_activations: the planned step held {measured} bytes ({mib(measured)}) "
                f"of saved activations, above the budget of {self.budget_bytes} bytes "
                f"({mib(self.budget_bytes)}); it saved what the profiled step did not (see "
                "docs/planner.md, 'What the plan does not handle'): profile a step like this one",
            )

    def __exit__(self, *args: object) -> None:
        entered, self._entered = self._entered, None
        if entered is None:
            return
        handle, held, hooks = entered
        try:
            hooks.__exit__(*args)  # type: ignore[attr-defined]  # a saved_tensors_hooks
        finally:
            handle.remove()
            self.measured_peak_bytes = held.peak[DEVICE]
            self.measured_host_peak_bytes = held.peak[HOST]
        if not self._quiet:
            self._warn_if_over()

    def report(self, *, rounds: int = 3) -> PlanReport:
        """Run the step under the plan: the measured peak and step time against the predicted.

        The peak is the one measured by the last ``with plan:`` block, or by one planned step
        run here; the step time is the median of ``rounds`` planned steps (after one that warms
        up). The parameters' ``.grad`` are put back as they were.

        Args:
            rounds: timed steps.

        Returns:
            A `PlanReport` (``print`` it for a summary).

        Raises:
            PlanArgumentValueError: if ``rounds`` is not a positive int (a ``ValueError``).
            PlanStateError: if the plan is applied now (inside ``with plan:``, or under a handle;
                a ``RuntimeError``).
        """
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise PlanArgumentValueError(f"report: rounds must be an int >= 1, got {rounds!r}")
        clock = StepClock(device_of(self._model, self.profile.device))
        samples = []
        with untouched(self._model, "report"):
            if self.measured_peak_bytes is None:
                with self:
                    self._step()
            with self.apply():
                samples = self._timed(clock, rounds)
        assert self.measured_peak_bytes is not None
        assert self.measured_host_peak_bytes is not None
        return PlanReport(
            budget_bytes=self.budget_bytes,
            predicted_peak_bytes=self.predicted_peak_bytes,
            measured_peak_bytes=self.measured_peak_bytes,
            predicted_host_bytes=self.predicted_host_bytes,
            measured_host_peak_bytes=self.measured_host_peak_bytes,
            predicted_step_seconds=self.predicted_step_seconds,
            measured_step_seconds=float(statistics.median(samples)),
            measured_step_range=(min(samples), max(samples)),
            device=self.profile.device,
        )

    def _timed(self, clock: StepClock, rounds: int) -> list[float]:
        samples = [clock.time(self._step) for _ in range(rounds + 1)]
        return samples[1:]  # the first warms up

    def __str__(self) -> str:
        profile = self.profile
        link = (
            "no host link (nothing offloaded)"
            if self.table.bandwidth is None
            else f"host link {self.table.bandwidth / 1e9:.1f} GB/s"
        )
        unplanned = profile.unplanned_step_seconds
        anchors = f"every block recomputed {profile.checkpointed_step_seconds * 1e3:.2f} ms"
        if unplanned is not None:
            anchors += f", none {unplanned * 1e3:.2f} ms"
        lines = [
            f"activation plan on {profile.device}, {link}",
            (
                f"budget {mib(self.budget_bytes)} ("
                f"{self.budget_bytes / max(self.unplanned_peak_bytes, 1):.2f} of the unplanned "
                f"{mib(self.unplanned_peak_bytes)}; least possible {mib(self.least_peak_bytes)})"
            ),
            (
                f"predicted: peak {mib(self.predicted_peak_bytes)}, host "
                f"{mib(self.predicted_host_bytes)}, step {self.predicted_step_seconds * 1e3:.2f} ms"
            ),
            f"(step with {anchors})",
            *plan_table(self.blocks, exact=self.exact),
        ]
        if self.note is not None:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<ActivationPlan of {len(self.blocks)} blocks: budget {self.budget_bytes} B, "
            f"predicted peak {self.predicted_peak_bytes} B, "
            f"step {self.predicted_step_seconds * 1e3:.3f} ms>"
        )


def _check_options(bandwidth: object, min_offload_bytes: object) -> None:
    if bandwidth is not None and (
        isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
    ):
        raise PlanArgumentTypeError(
            f"plan_activations: bandwidth must be a number of bytes per second or None, got "
            f"{bandwidth!r} of type {type(bandwidth).__name__}"
        )
    if bandwidth is not None and not bandwidth > 0:
        raise PlanArgumentValueError(
            f"plan_activations: bandwidth must be positive (bytes per second), got {bandwidth!r}"
        )
    if (
        isinstance(min_offload_bytes, bool)
        or not isinstance(min_offload_bytes, int)
        or min_offload_bytes < 0
    ):
        raise PlanArgumentValueError(
            f"plan_activations: min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}"
        )


def _profile_for(
    model: nn.Module,
    step: Callable[[], object],
    blocks: Sequence[nn.Module] | None,
    profile: StepProfile | None,
) -> tuple[list[nn.Module], StepProfile]:
    """The blocks and their profile, both in the order the step runs the blocks."""
    named = resolve_blocks(model, blocks, "plan_activations")
    if profile is None:
        listed = None if blocks is None else [module for _, module in named]
        profile = profile_step(model, step, blocks=listed)
    elif not isinstance(profile, StepProfile):
        raise PlanArgumentTypeError(
            f"plan_activations: profile must be a StepProfile (from profile_step), got "
            f"{profile!r} of type {type(profile).__name__}"
        )
    else:
        check_model_state(model, "plan_activations")
    by_name = {**dict(model.named_modules()), "(model)": model}
    profiled = [block.name for block in profile.blocks]
    if blocks is not None and sorted(name for name, _ in named) != sorted(profiled):
        raise PlanArgumentValueError(
            f"plan_activations: the profile is of blocks {profiled}, not of "
            f"{[name for name, _ in named]}; pass the blocks the profile was made with, or "
            "profile again"
        )
    missing = [name for name in profiled if name not in by_name]
    if missing:
        raise PlanArgumentValueError(
            f"plan_activations: the profile is of blocks {missing} that {type(model).__name__} "
            "does not have; pass the model the profile was made of, or profile again"
        )
    return [by_name[name] for name in profiled], profile


def plan_activations(
    model: nn.Module,
    step: Callable[[], object],
    budget: int | float | str,
    *,
    blocks: Sequence[nn.Module] | None = None,
    profile: StepProfile | None = None,
    bandwidth: float | None = None,
    min_offload_bytes: int = _DEFAULT_MIN_OFFLOAD_BYTES,
    confirm: bool = True,
) -> ActivationPlan:
    """Choose, per block and per op, what to keep, recompute or offload so that the step fits.

    ``step`` is recorded once (`profile_step`), unless ``profile`` is given, and then run once
    more under the chosen plan to confirm it (``plan.measured_peak_bytes``). The solver
    picks, for every block, one of: keep what it saves; checkpoint it with a policy that saves,
    recomputes or offloads each op's output; and offload the block's input too. It is exact over
    those choices (a dynamic programme over the blocks) and returns the fastest plan whose
    predicted peak of bytes held for backward is at most ``budget``; a larger budget never
    predicts a slower step. Views and tiny tensors are never offloaded; offloading is only
    chosen where the link's copies hide behind compute (see docs/planner.md for the cost model).
    Applied, the plan is solved again, before a step runs, for inputs larger than the profiled
    ones (see docs/planner.md, "Batches of other sizes").

    Example:
        >>> import torch, tensorhooks
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(4)))
        >>> x = torch.randn(32, 64)
        >>> step = lambda: model(x).sum().backward()
        >>> plan = tensorhooks.plan_activations(model, step, budget=0.5)
        >>> plan.predicted_peak_bytes <= plan.budget_bytes
        True
        >>> with plan:
        ...     step()
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True

    Args:
        model: the model ``step`` trains.
        step: runs one forward and backward the way training does, with the real shapes, and
            no optimizer step (it is called several times).
        budget: bytes (an int), a fraction in (0, 1] of the peak with no plan (a float), or a
            size with units (``"8GB"``, ``"512MiB"``, ``"1.5GiB"``: KB, MB, GB, TB are powers
            of 1000, KiB, MiB, GiB, TiB of 1024).
        blocks: the modules to plan, each called once per step; default: the layers of every
            stack of repeated layers (``model.model.layers`` of a Hugging Face model, both
            ``encoder.block`` and ``decoder.block`` of T5). Planned in the order the step runs
            them.
        profile: a `StepProfile` of these blocks, to plan without profiling again.
        bandwidth: host↔device bytes per second to plan offloading for; default: the
            profile's (measured on CUDA; none on a CPU, where nothing is offloaded).
        min_offload_bytes: tensors smaller than this are never offloaded.
        confirm: when ``step`` is profiled here, run it once under the plan to measure its peak
            (``plan.measured_peak_bytes``), and solve again with what it measured should it
            hold more than the budget. No step runs when ``profile`` is given.

    Returns:
        The `ActivationPlan`.

    Raises:
        PlanArgumentTypeError: if ``model``, ``step``, ``budget``, ``blocks``, ``profile``,
            ``bandwidth`` or ``confirm`` has the wrong type (a ``TypeError``).
        PlanArgumentValueError: if ``budget`` is not positive, a float budget is above 1, a
            string budget is not a size, ``bandwidth`` is not positive, ``min_offload_bytes``
            is negative, or the blocks are not the profile's (a ``ValueError``).
        PlanBudgetError: if ``budget`` is below the least peak any plan reaches; the message
            names that figure (a ``ValueError``).
        PlanStateError: if a block runs twice in the step, or not at all; the step runs no
            backward, records a graph in backward (``create_graph=True``) or changes a
            parameter; or the model's own gradient checkpointing is on (Hugging Face's
            ``gradient_checkpointing_enable()``) (a ``RuntimeError``).
    """
    check_step(step, "plan_activations")
    _check_options(bandwidth, min_offload_bytes)
    if not isinstance(confirm, bool):
        raise PlanArgumentTypeError(
            f"plan_activations: confirm must be a bool, got {confirm!r} of type "
            f"{type(confirm).__name__}"
        )
    profiled_here = profile is None
    modules, profile = _profile_for(model, step, blocks, profile)
    planner = _Planner(
        model,
        step,
        modules=modules,
        bandwidth=bandwidth,
        min_offload_bytes=min_offload_bytes,
        default_blocks=blocks is None,
    )
    plan = planner.planned(profile, budget)
    if profiled_here and confirm:
        plan = planner.confirmed(plan)
    return plan


class _Planner:
    """What a plan of ``model`` is made from, besides its profile and budget."""

    def __init__(
        self,
        model: nn.Module,
        step: Callable[[], object],
        *,
        modules: list[nn.Module],
        bandwidth: float | None,
        min_offload_bytes: int,
        default_blocks: bool,
    ) -> None:
        self.model = model
        self.step = step
        self.modules = modules
        self.bandwidth = bandwidth
        self.min_offload_bytes = min_offload_bytes
        self.no_stacks = default_blocks and not repeated_stacks(model)

    def planned(self, profile: StepProfile, budget: object) -> ActivationPlan:
        """The fastest plan of ``profile`` within ``budget``.

        Raises:
            PlanBudgetError: if ``budget`` is below the least peak any plan reaches.
        """
        link = profile.bandwidth if self.bandwidth is None else float(self.bandwidth)
        table, keys = cost_table(profile, link, self.min_offload_bytes)
        menus = [block_menu(block, link) for block in table.blocks]
        unplanned = plan_peak(table, [choice_outcome(block, KEEP, link) for block in table.blocks])
        least = least_peak(table, menus)
        budget_bytes = budget_in_bytes(budget, unplanned, "plan_activations")
        if budget_bytes < least:
            hint = (
                "; with a host link (bandwidth=...) offloading could lower it"
                if link is None
                else ""
            )
            if self.no_stacks:
                hint += f"; {NO_STACKS}"
            raise PlanBudgetError(
                f"plan_activations: budget={budget!r} ({budget_bytes} bytes, "
                f"{mib(budget_bytes)}) is below the least peak any plan reaches: {least} bytes "
                f"({mib(least)}, {least / max(unplanned, 1):.3f} of the unplanned peak of "
                f"{unplanned} bytes); pass budget >= {least}{hint}"
            )
        solution = solve(table, menus, budget_bytes)
        assert solution is not None  # the least peak is reached by some plan
        return ActivationPlan(
            model=self.model,
            step=self.step,
            modules=self.modules,
            profile=profile,
            table=table,
            keys=keys,
            solution=solution,
            budget_bytes=budget_bytes,
            least_peak_bytes=least,
            unplanned_peak_bytes=unplanned,
            exact=all(menu.exact for menu in menus),
            min_offload_bytes=self.min_offload_bytes,
            note=NO_STACKS if self.no_stacks else None,
        )

    def confirmed(self, plan: ActivationPlan) -> ActivationPlan:
        """``plan`` after one planned step: measured, and solved again if it held too much.

        See NOTE [The confirming step].
        """
        measured = plan._confirm()
        if measured <= plan.budget_bytes:
            return plan
        excess = measured - plan.predicted_peak_bytes
        profile = dataclasses.replace(
            plan.profile, fixed_bytes=plan.profile.fixed_bytes + max(excess, 0)
        )
        try:
            again = self.planned(profile, plan.budget_bytes)
        except PlanBudgetError:
            again = plan
        if again is not plan:
            again._confirm()
        again._warn_if_over()
        return again
