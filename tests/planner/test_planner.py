"""plan_activations on real models: within budget, as predicted, with plain autograd's gradients."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the conventional name
from torch import nn

import tensorhooks as th
from tensorhooks.cli._models import (
    LlamaConfig,
    ModelConfig,
    TinyLlama,
    TinyTransformer,
    make_batch,
    make_tokens,
)


@dataclass
class Workload:
    """A float64 model, the step that trains it, and one profile of that step."""

    model: nn.Module
    step: Callable[[], None]
    profile: th.StepProfile

    def grads(self) -> list[torch.Tensor]:
        """Run the step with no plan; its gradients (the model's .grad left empty)."""
        self.step()
        return take_grads(self.model)


def take_grads(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' gradients, cleared from the model."""
    grads = [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Bit for bit."""
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine, other)


def transformer() -> tuple[nn.Module, Callable[[], None]]:
    """The CLI's tiny transformer (LayerNorm, explicit attention, GELU MLP), four blocks."""
    config = ModelConfig(batch=2, seq=16, d_model=32, heads=4, layers=4, vocab=64)
    torch.manual_seed(0)
    model = TinyTransformer(config).double()
    tokens, targets = make_batch(config)
    return model, lambda: model(tokens, targets).backward()


def llama() -> tuple[nn.Module, Callable[[], None]]:
    """The demo's tiny Llama (rotary attention, SwiGLU and mixture-of-experts layers)."""
    config = LlamaConfig()
    model = TinyLlama(config).double()
    tokens = make_tokens(config)
    return model, lambda: model(tokens).backward()


MODELS = {"transformer": transformer, "llama": llama}


@pytest.fixture(scope="module", params=sorted(MODELS))
def workload(request: pytest.FixtureRequest) -> Workload:
    """Each model with its profile (one timed round: the tests check bytes, not times)."""
    model, step = MODELS[request.param]()
    return Workload(model, step, th.profile_step(model, step, rounds=1))


def budgets(plan: th.ActivationPlan) -> list[int]:
    """Five budgets from the least feasible to the unplanned peak."""
    low, high = plan.least_peak_bytes, plan.unplanned_peak_bytes
    return [low + (high - low) * k // 4 for k in range(5)]


def test_profile_predicts_the_measured_unplanned_and_checkpointed_peaks(
    workload: Workload,
) -> None:
    """Keep-all and recompute-all, predicted from the profile, equal what their steps measured."""
    profile = workload.profile
    plan = th.plan_activations(workload.model, workload.step, 1.0, profile=profile)
    assert profile.unplanned_peak_bytes == plan.unplanned_peak_bytes
    every_block_recomputed = max(
        profile.fixed_bytes
        + sum(block.input_bytes for block in profile.blocks)
        + profile.after_bytes,
        *(
            profile.fixed_bytes
            + sum(block.input_bytes for block in profile.blocks[:index])
            + block.saved_and_input_bytes
            for index, block in enumerate(profile.blocks)
        ),
    )
    assert profile.checkpointed_peak_bytes == every_block_recomputed


def test_measured_peak_within_budget_and_prediction(workload: Workload) -> None:
    """From the least feasible budget to 100%: within budget, within 5% of predicted, same grads."""
    reference = workload.grads()
    first = th.plan_activations(workload.model, workload.step, 1.0, profile=workload.profile)
    for budget in budgets(first):
        plan = th.plan_activations(workload.model, workload.step, budget, profile=workload.profile)
        with plan:
            workload.step()
        assert plan.measured_peak_bytes is not None
        assert plan.predicted_peak_bytes <= budget
        assert plan.measured_peak_bytes <= budget
        assert abs(plan.measured_peak_bytes - plan.predicted_peak_bytes) <= (
            0.05 * plan.predicted_peak_bytes
        )
        assert_same(take_grads(workload.model), reference)


def test_tighter_budgets_checkpoint_more(workload: Workload) -> None:
    """The least budget recomputes every block; the whole budget keeps every block."""
    least = th.plan_activations(workload.model, workload.step, 1.0, profile=workload.profile)
    tight = th.plan_activations(
        workload.model, workload.step, least.least_peak_bytes, profile=workload.profile
    )
    assert all(block.checkpoint for block in tight.blocks[:-1])
    assert not any(block.checkpoint for block in least.blocks)
    assert least.predicted_step_seconds <= tight.predicted_step_seconds


def test_budget_below_the_least_names_it(workload: Workload) -> None:
    """A budget under the least peak raises PlanBudgetError with that figure in bytes."""
    plan = th.plan_activations(workload.model, workload.step, 1.0, profile=workload.profile)
    least = plan.least_peak_bytes
    with pytest.raises(th.PlanBudgetError, match=rf"least peak any plan reaches: {least} bytes"):
        th.plan_activations(workload.model, workload.step, least - 1, profile=workload.profile)
    with pytest.raises(ValueError, match=r"pass budget >= \d+; with a host link"):
        th.plan_activations(workload.model, workload.step, 0.01, profile=workload.profile)


def test_simulated_link_offloads_and_counts_host_bytes(workload: Workload) -> None:
    """With a link, a budget below the no-offload least is met by offloading, counted as host."""
    model, step, profile = workload.model, workload.step, workload.profile
    no_link = th.plan_activations(model, step, 1.0, profile=profile).least_peak_bytes
    reference = workload.grads()
    linked = th.plan_activations(
        model, step, 1.0, profile=profile, bandwidth=1e12, min_offload_bytes=0
    )
    assert linked.least_peak_bytes < no_link
    plan = th.plan_activations(
        model, step, linked.least_peak_bytes, profile=profile, bandwidth=1e12, min_offload_bytes=0
    )
    assert any(block.offloaded or block.offload_input for block in plan.blocks)
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_host_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.measured_host_peak_bytes > 0
    assert abs(plan.measured_peak_bytes - plan.predicted_peak_bytes) <= 0.05 * plan.budget_bytes
    assert_same(take_grads(model), reference)


def test_slow_link_offloads_nothing_it_cannot_hide(workload: Workload) -> None:
    """At a budget with room, a link too slow to hide any copy is not used."""
    model, step, profile = workload.model, workload.step, workload.profile
    plan = th.plan_activations(
        model, step, 0.7, profile=profile, bandwidth=1.0, min_offload_bytes=0
    )
    assert not any(block.offloaded or block.offload_input for block in plan.blocks)


def test_report_compares_prediction_and_measurement(workload: Workload) -> None:
    """report() measures a planned step and times it; .grad is left as it was."""
    plan = th.plan_activations(workload.model, workload.step, 0.6, profile=workload.profile)
    report = plan.report(rounds=1)
    assert report.within_budget
    assert abs(report.peak_error) <= 0.05
    assert report.measured_step_seconds > 0
    assert "saved-activation peak: predicted" in str(report)
    assert all(p.grad is None for p in workload.model.parameters())


def test_plan_table_names_every_block(workload: Workload) -> None:
    """str(plan) has a line per block with its choice, and the budget line."""
    plan = th.plan_activations(workload.model, workload.step, 0.5, profile=workload.profile)
    text = str(plan)
    assert "budget" in text
    for block in plan.blocks:
        assert any(
            line.startswith(block.name) and block.choice in line for line in text.splitlines()
        )


class DropoutBlock(nn.Module):
    """Linear, dropout, GELU, Linear, dropout, with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, 4 * width)
        self.second = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.first(x)), 0.3, self.training)
        return x + F.dropout(self.second(h), 0.3, self.training)


def test_dropout_replays_its_random_numbers() -> None:
    """With dropout, every plan gives the unplanned gradients (recomputation replays the RNG)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(DropoutBlock(16) for _ in range(4))).double()
    x = torch.randn(8, 16, dtype=torch.float64)

    def step() -> None:
        torch.manual_seed(123)
        model(x).square().sum().backward()

    step()
    reference = take_grads(model)
    profile = th.profile_step(model, step, rounds=1)
    for budget in (0.05, 0.3, 0.6, 1.0):
        try:
            plan = th.plan_activations(model, step, budget, profile=profile)
        except th.PlanBudgetError:
            continue
        with plan:
            step()
        assert_same(take_grads(model), reference)
    assert profile.blocks[0].saved_bytes > 0


def test_default_blocks_are_the_repeated_children() -> None:
    """Blocks default to the layers of the stack of same-class modules, found breadth-first."""
    model, _ = llama()
    assert [id(b) for b in th._planner.blocks.default_blocks(model)] == [  # type: ignore[attr-defined]
        id(layer) for layer in model.layers
    ]


def mlp_block(width: int = 16) -> nn.Module:
    """Linear, GELU, Linear: saves its input and two wider tensors."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


@pytest.fixture
def small() -> tuple[nn.Module, Callable[[], None]]:
    """An MLP of three (Linear, GELU, Linear) blocks and its step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(mlp_block() for _ in range(3))).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    return model, lambda: model(x).sum().backward()


def test_apply_and_remove(small: tuple[nn.Module, Callable[[], None]]) -> None:
    """A handle applies the plan until remove(); blocks get their own forward back."""
    model, step = small
    plan = th.plan_activations(model, step, 0.5)
    forwards = [block.__dict__.get("forward") for block in model]
    handle = plan.apply(measure=True)
    assert all("forward" in block.__dict__ for block in model)
    with pytest.raises(th.PlanStateError, match="already runs under a plan"):
        plan.apply()
    step()
    assert handle.measured_peak_bytes is not None
    handle.remove()
    assert [block.__dict__.get("forward") for block in model] == forwards
    with pytest.raises(th.PlanStateError, match="already removed"):
        handle.remove()


def test_plan_does_not_nest(small: tuple[nn.Module, Callable[[], None]]) -> None:
    """Entering a plan inside itself raises; the outer one still exits cleanly."""
    model, step = small
    plan = th.plan_activations(model, step, 1.0)
    with plan:
        with pytest.raises(th.PlanStateError, match="plans do not nest"):
            plan.__enter__()
        step()
    assert "forward" not in model[0].__dict__


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"budget": [1]}, th.PlanArgumentTypeError, r"budget must be an int .* got \[1\]"),
        ({"budget": "half"}, th.PlanArgumentValueError, r"budget 'half' is not a size"),
        ({"budget": 1.5}, th.PlanArgumentValueError, r"must be in \(0, 1\], got 1\.5"),
        ({"budget": -3}, th.PlanArgumentValueError, r"budget must be positive, got -3"),
        ({"bandwidth": 0.0}, th.PlanArgumentValueError, r"bandwidth must be positive"),
        ({"bandwidth": "fast"}, th.PlanArgumentTypeError, r"bandwidth must be a number"),
        ({"min_offload_bytes": -1}, th.PlanArgumentValueError, r"min_offload_bytes must be"),
        ({"blocks": ["x"]}, th.PlanArgumentTypeError, r"blocks\[0\] is 'x' of type str"),
        ({"profile": 3}, th.PlanArgumentTypeError, r"profile must be a StepProfile"),
    ],
)
def test_argument_errors(
    small: tuple[nn.Module, Callable[[], None]],
    arguments: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    """Each bad argument raises its error class, naming the value."""
    model, step = small
    options: dict[str, object] = {"budget": 0.5, **arguments}
    with pytest.raises(error, match=match):
        th.plan_activations(model, step, **options)  # type: ignore[arg-type]


def test_model_and_step_are_checked() -> None:
    """A model that is not a module, or a step that is not callable, is a type error."""
    with pytest.raises(th.PlanArgumentTypeError, match=r"model must be an nn\.Module, got 3"):
        th.profile_step(3, lambda: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"step must be a function .* got None"):
        th.plan_activations(nn.Linear(2, 2), None, 0.5)  # type: ignore[arg-type]
    with pytest.raises(th.PlanArgumentValueError, match=r"rounds must be an int >= 1, got 0"):
        th.profile_step(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), lambda: None, rounds=0)


def test_profile_of_other_blocks_is_refused(small: tuple[nn.Module, Callable[[], None]]) -> None:
    """A profile made for other blocks is not used for these."""
    model, step = small
    profile = th.profile_step(model, step, rounds=1)
    with pytest.raises(th.PlanArgumentValueError, match=r"the profile is of blocks"):
        th.plan_activations(model, step, 0.5, blocks=[model[0], model[1]], profile=profile)


def test_block_run_twice_is_refused() -> None:
    """A block called twice in one step cannot be profiled: the error says so."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(th.PlanStateError, match=r"block 0 ran twice in one step"):
        th.profile_step(model, lambda: shared(model(x)).sum().backward(), blocks=[shared])


def test_block_that_does_not_run_is_refused() -> None:
    """A block the step never calls cannot be planned."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(th.PlanStateError, match=r"blocks \[1\] did not run"):
        th.profile_step(model, lambda: model[0](x).sum().backward())


def test_profile_can_be_changed_to_plan_for_another_machine(
    small: tuple[nn.Module, Callable[[], None]],
) -> None:
    """A profile is a frozen dataclass: replace() gives a plan for other measurements."""
    model, step = small
    profile = th.profile_step(model, step, rounds=1)
    slower = replace(profile, checkpointed_step_seconds=profile.checkpointed_step_seconds + 1.0)
    plan = th.plan_activations(model, step, 1.0, profile=slower)
    assert plan.predicted_step_seconds >= 1.0


def test_profile_without_the_unplanned_step(small: tuple[nn.Module, Callable[[], None]]) -> None:
    """unplanned=False records the step checkpointed: the same bytes; plans are made and fit."""
    model, step = small
    profile = th.profile_step(model, step, rounds=1, unplanned=False)
    assert profile.unplanned_peak_bytes is None
    unplanned = th.profile_step(model, step, rounds=1)
    assert profile.checkpointed_peak_bytes == unplanned.checkpointed_peak_bytes
    for ours, theirs in zip(profile.blocks, unplanned.blocks, strict=True):
        assert [op.saved_bytes for op in ours.ops] == [op.saved_bytes for op in theirs.ops]
        assert (ours.saved_bytes, ours.input_bytes) == (theirs.saved_bytes, theirs.input_bytes)
    plan = th.plan_activations(model, step, 0.5, profile=profile)
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_plan_with_the_measured_link() -> None:
    """On CUDA: the link is measured, offloading plans fit, gradients as unplanned (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(mlp_block(256) for _ in range(4))).double().cuda()
    x = torch.randn(64, 256, dtype=torch.float64, device="cuda")

    def step() -> None:
        model(x).square().sum().backward()

    step()
    reference = take_grads(model)
    profile = th.profile_step(model, step, rounds=1)
    assert profile.device.startswith("cuda")
    assert profile.bandwidth is not None
    assert profile.bandwidth > 1e8
    least = th.plan_activations(model, step, 1.0, profile=profile, min_offload_bytes=0)
    plan = th.plan_activations(
        model, step, least.least_peak_bytes, profile=profile, min_offload_bytes=0
    )
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert abs(plan.measured_peak_bytes - plan.predicted_peak_bytes) <= 0.05 * plan.budget_bytes
    assert_same(take_grads(model), reference)
