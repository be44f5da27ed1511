"""A plan over a run whose batches differ in size (`_planner.sizing`, `_planner.shapes`).

Transformers models built from tiny configs (as in test_transformers.py), profiled on one batch
and run on batches of other rows and lengths: the bytes the profile predicts at other sizes, and
the measured peak of every step against the budget.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tensorhooks as th
from tensorhooks._planner.shapes import ratios_for, signature_of
from tensorhooks._planner.sizing import scaled_profile
from tests.planner.test_transformers import MODELS, VOCAB

Step = Callable[[], None]


def quiet(name: str) -> nn.Module:
    """The model in training mode, without dropout (the tests compare bytes step by step)."""
    torch.manual_seed(0)
    model = MODELS[name]().train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def step_on(model: nn.Module, rows: int, length: int, labels: int | None = None) -> Step:
    """A step on a batch of ``rows`` x ``length`` tokens (labels of another length: T5's)."""
    generator = torch.Generator().manual_seed(rows * 1000 + length)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    targets = ids if labels is None else torch.randint(3, VOCAB, (rows, labels))

    def step() -> None:
        model(input_ids=ids, labels=targets).loss.backward()

    step.inputs = {"input_ids": ids, "labels": targets}  # type: ignore[attr-defined]
    return step


FIGURES = ("saved_bytes", "input_bytes", "saved_and_input_bytes", "following_bytes")


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "bert"])
def test_scaled_profile_is_the_profile_at_those_sizes(name: str) -> None:
    """The profile of 3 x 20 tokens scaled to 5 x 40 has the bytes of a profile of 5 x 40."""
    model = quiet(name)
    small, large = step_on(model, 3, 20), step_on(model, 5, 40)
    profile = th.profile_step(model, small)
    expected = th.profile_step(model, large)
    assert profile.sizes is not None
    signature = signature_of((), large.inputs)  # type: ignore[attr-defined]
    ratios = ratios_for(profile.sizes, signature)
    assert ratios is not None
    scaled = scaled_profile(profile, ratios)
    assert (scaled.fixed_bytes, scaled.after_bytes) == (expected.fixed_bytes, expected.after_bytes)
    for ours, theirs in zip(scaled.blocks, expected.blocks, strict=True):
        assert [getattr(ours, f) for f in FIGURES] == [getattr(theirs, f) for f in FIGURES]
        assert [(op.saved_bytes, op.other_bytes) for op in ours.ops] == [
            (op.saved_bytes, op.other_bytes) for op in theirs.ops
        ]


def test_sizes_that_depend_on_the_data_are_not_underestimated() -> None:
    """Mixtral's tokens per expert follow the routing: scaled, each block figure is no less."""
    model = quiet("mixtral")
    small, large = step_on(model, 3, 20), step_on(model, 5, 40)
    profile = th.profile_step(model, small)
    expected = th.profile_step(model, large)
    assert profile.sizes is not None
    ratios = ratios_for(profile.sizes, signature_of((), large.inputs))  # type: ignore[attr-defined]
    assert ratios is not None
    scaled = scaled_profile(profile, ratios)
    for ours, theirs in zip(scaled.blocks, expected.blocks, strict=True):
        for figure in FIGURES:
            assert getattr(ours, figure) >= getattr(theirs, figure), figure


def budget_for(model: nn.Module, small: Step, large: Step) -> int:
    """A budget every batch up to ``large`` fits: the least peak there, or the small unplanned.

    With 2% to spare: sizes that depend on the data (an expert's tokens) are scaled as their
    op's inputs grow, at most, so a plan for a larger batch may hold a little less than it can.
    """
    least = th.plan_activations(model, large, 1.0, confirm=False).least_peak_bytes
    unplanned = th.profile_step(model, small).unplanned_peak_bytes
    assert unplanned is not None
    return max(least * 102 // 100, unplanned)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_plan_holds_on_every_step_of_a_run_with_varying_shapes(name: str) -> None:
    """Profiled on 3 x 24, run on batches of 1-5 rows and 8-48 tokens: every step in budget."""
    model = quiet(name)
    small = step_on(model, 3, 24)
    budget = budget_for(model, small, step_on(model, 5, 48))
    plan = th.plan_activations(model, small, budget)
    draw = random.Random(0)
    shapes = [(5, 48), *((draw.randint(1, 5), draw.randrange(8, 49, 8)) for _ in range(9))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", th.PlanBudgetWarning)
        for rows, length in shapes:
            with plan:
                step_on(model, rows, length)()
            model.zero_grad(set_to_none=True)
            assert plan.measured_peak_bytes is not None
            assert plan.measured_peak_bytes <= budget, (rows, length)
    assert plan.replans >= 1


def test_plan_holds_when_the_change_is_in_a_tensor_the_first_does_not_show() -> None:
    """T5 with the encoder's batch fixed and the decoder's length varying: every step in budget."""
    model = quiet("t5")
    small = step_on(model, 3, 24, labels=16)
    budget = budget_for(model, small, step_on(model, 3, 24, labels=48))
    plan = th.plan_activations(model, small, budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error", th.PlanBudgetWarning)
        for labels in (48, 8, 32, 40, 16, 24):
            with plan:
                step_on(model, 3, 24, labels=labels)()
            model.zero_grad(set_to_none=True)
            assert plan.measured_peak_bytes is not None
            assert plan.measured_peak_bytes <= budget, labels
    assert plan.replans == 4  # 48, 32, 40 and 24 are larger than the profiled 16


def test_smaller_steps_run_the_profiled_plan() -> None:
    """Batches no larger than the profiled one are not planned again, and fit."""
    model = quiet("qwen3")
    plan = th.plan_activations(model, step_on(model, 3, 32), 0.5)
    for rows, length in ((1, 8), (3, 32), (2, 16)):
        with plan:
            step_on(model, rows, length)()
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.replans == 0


def test_a_step_no_plan_fits_warns_once_with_the_figure() -> None:
    """A batch whose least peak is above the budget warns once, naming that least peak."""
    model = quiet("llama")
    small = step_on(model, 2, 16)
    plan = th.plan_activations(model, small, 1.0)
    large = step_on(model, 8, 64)
    least = th.plan_activations(model, large, 1.0, confirm=False).least_peak_bytes
    assert least > plan.budget_bytes
    warned = pytest.warns(th.PlanBudgetWarning, match=r"needs at least \d+ bytes .* above the")
    with warned, plan.apply():
        large()
    with warnings.catch_warnings():
        warnings.simplefilter("error", th.PlanBudgetWarning)
        with plan.apply():
            step_on(model, 8, 56)()  # another too large a batch: not warned again


class Layer(nn.Module):
    """A residual MLP over the last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_a_step_that_calls_the_blocks_is_sized_by_the_first_block() -> None:
    """Without a call of the model itself, the first block's arguments give the sizes."""
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(4))

    def step_with(rows: int) -> Step:
        x = torch.randn(rows, 16)

        def step() -> None:
            h = x
            for layer in model.layers:
                h = layer(h)
            h.square().mean().backward()

        return step

    profile = th.profile_step(model, step_with(8))
    assert profile.sizes is not None
    assert profile.sizes.source == "block"
    least = th.plan_activations(model, step_with(32), 1.0, confirm=False).least_peak_bytes
    plan = th.plan_activations(model, step_with(8), max(least, 2 * profile.blocks[0].saved_bytes))
    for rows in (32, 4, 24):
        with plan:
            step_with(rows)()
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= plan.budget_bytes, rows
    assert plan.replans == 2


class Repeats(nn.Module):
    """A residual MLP over its input repeated ``times`` along the rows (a size of its own)."""

    times = 1

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.repeat(Repeats.times, 1))[: x.shape[0]]


def test_a_step_that_grows_where_the_inputs_do_not_is_warned_of_once() -> None:
    """Sizes the model's inputs do not show: the measured peak above the budget is warned of."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Repeats() for _ in range(3)))
    x = torch.randn(8, 16)

    def step() -> None:
        model(x).square().mean().backward()

    plan = th.plan_activations(model, step, 1.0)
    Repeats.times = 4
    try:
        with pytest.warns(th.PlanBudgetWarning, match=r"held \d+ bytes .* above the budget"), plan:
            step()
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes > plan.budget_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("error", th.PlanBudgetWarning)
            with plan:  # warned once
                step()
    finally:
        Repeats.times = 1


def test_the_model_gets_its_forward_back_and_a_later_wrapper_stays() -> None:
    """Removing a plan gives the model its forward; one wrapped meanwhile (a trainer's) stays."""
    model = quiet("qwen3")
    plan = th.plan_activations(model, step_on(model, 2, 16), 0.6)
    with plan.apply():
        assert "forward" in model.__dict__  # watching the sizes of each call
    assert "forward" not in model.__dict__
    handle = plan.apply()
    inner = model.forward

    def wrapped(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    model.forward = wrapped  # type: ignore[method-assign]
    handle.remove()
    assert model.forward is wrapped
    del model.forward
