"""explain: the peak of a step as it runs, attributed to modules and ops, and the plan that fits.

The peak is checked against the planner's own measurement (`ActivationPlan.measured_peak_bytes`
and the profile's unplanned peak), which counts the same bytes with other hooks: with no
checkpointing, under a plan, under torch's checkpoint (reentrant or not) and a selective policy,
under torch's and tensorhooks' offloading.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the conventional name
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import tensorhooks as th
from tensorhooks._core.torch_compat import current_dispatch_mode, top_saved_tensors_hooks
from tensorhooks._planner.accounting import DEVICE, HeldBytes, holding_hooks, module_keys
from tensorhooks._planner.apply import SAVE, Action, Application


def measured_peak(
    model: nn.Module, blocks: list[nn.Module], actions: list[Action], step: Callable[[], object]
) -> int:
    """The peak the planner measures with ``blocks`` run as ``actions`` say (as ``with plan:``)."""
    held = HeldBytes(module_keys(model))
    application = Application(blocks, actions, held=held)
    application.install()
    try:
        with holding_hooks(held):
            step()
    finally:
        application.remove()
    return held.peak[DEVICE]


class Block(nn.Module):
    """A residual MLP block: a norm, an up-projection, GELU, a down-projection."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Wrapped(nn.Module):
    """A block run through ``run(block, x)``: a checkpoint of the user's choosing."""

    def __init__(self, block: nn.Module, run: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.block, x)


def stack(blocks: int = 4, width: int = 16, hidden: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, hidden) for _ in range(blocks)))


def stepper(model: nn.Module, rows: int = 32, width: int = 16) -> Callable[[], None]:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return lambda: model(x).square().mean().backward()


def wrapped(model: nn.Sequential, run: Callable[..., torch.Tensor]) -> nn.Sequential:
    return nn.Sequential(*(Wrapped(block, run) for block in model))


def non_reentrant(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


def reentrant(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(block, x, use_reentrant=True)


def full_checkpoint_peak(model: nn.Sequential, step: Callable[[], None]) -> int:
    """The planner's measurement with every block under tensorhooks' checkpoint."""
    return measured_peak(model, list(model), [Action(checkpoint=True)] * len(model), step)


@settings(max_examples=8, deadline=None)
@given(
    blocks=st.integers(2, 4),
    width=st.sampled_from([8, 16]),
    hidden=st.sampled_from([16, 48]),
    rows=st.integers(1, 12),
)
def test_peak_is_the_planners_unplanned_peak(
    blocks: int, width: int, hidden: int, rows: int
) -> None:
    """With no checkpointing, the peak is the planner's measured unplanned peak, to the byte."""
    model = stack(blocks, width, hidden)
    step = stepper(model, rows, width)
    profile = th.profile_step(model, step, rounds=1)
    explanation = th.explain(model, step)
    assert explanation.peak_bytes == profile.unplanned_peak_bytes
    assert not explanation.peak_in_backward  # nothing is recomputed: the end of the forward


@pytest.mark.parametrize("fraction", [None, 0.5, 1.0])
def test_peak_of_a_planned_step_is_the_plans_measurement(fraction: float | None) -> None:
    """A step run under a plan: the peak is what ``with plan:`` measures, the least one included."""
    model = stack()
    step = stepper(model)
    profile = th.profile_step(model, step, rounds=1)
    least = th.plan_activations(model, step, 1.0, profile=profile).least_peak_bytes
    plan = th.plan_activations(model, step, fraction or least, profile=profile)

    def planned() -> None:
        with plan.apply():
            step()

    explanation = th.explain(model, planned)
    with plan:
        step()
    assert explanation.peak_bytes == plan.measured_peak_bytes


@pytest.mark.parametrize("run", [non_reentrant, reentrant], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_holds_what_tensorhooks_checkpoint_holds(
    run: Callable[..., torch.Tensor],
) -> None:
    """Every block under torch's checkpoint: the peak of tensorhooks' full checkpoint, measured."""
    model = stack()
    explanation = th.explain(wrapped(model, run), stepper(wrapped(model, run)))
    assert explanation.peak_bytes == full_checkpoint_peak(model, stepper(model))
    assert explanation.peak_in_backward  # a recomputation on top of every block's input
    kinds = {tensor.kind for tensor in explanation.held}
    expected = {"input", "recomputed"} if run is non_reentrant else {"saved", "recomputed"}
    assert expected <= kinds


def save_up(ctx: object, op: object, *args: torch.Tensor, **kwargs: object) -> object:
    """Save the up-projection's matmul (its bias has the hidden width, 64), recompute the rest."""
    if op is torch.ops.aten.addmm.default and args[0].shape == (64,):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def selective(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, save_up)
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)


def test_selective_policy_holds_what_the_planner_counts() -> None:
    """Selective checkpoint of torch saving the up-projection: what the planner counts for it."""
    model = stack()
    actions = [Action(True, {(torch.ops.aten.addmm.default, 0): SAVE}, selective=True)] * 4
    expected = measured_peak(model, list(model), actions, stepper(model))
    run = wrapped(model, selective)
    explanation = th.explain(run, stepper(run))
    assert explanation.peak_bytes == expected
    assert "policy" in {tensor.kind for tensor in explanation.held}
    assert explanation.peak_bytes < th.explain(model, stepper(model)).peak_bytes


@pytest.mark.parametrize(
    "offload", [th.save_on_cpu, torch.autograd.graph.save_on_cpu], ids=["tensorhooks", "torch"]
)
def test_offloaded_tensors_are_host_bytes(offload: Callable[[], object]) -> None:
    """Under save_on_cpu every save is offloaded: host bytes, as the planner counts them."""
    model = stack()
    step = stepper(model)

    def offloaded() -> None:
        with offload():  # type: ignore[attr-defined]  # a context manager
            step()

    explanation = th.explain(model, offloaded)
    assert explanation.peak_bytes == 0
    assert explanation.host_peak_bytes == th.explain(model, step).peak_bytes
    assert {tensor.status for tensor in explanation.held} == {"offloaded"}


def test_held_tensors_add_up_to_the_peak() -> None:
    """The device tensors held at the peak add up to it; the timeline never passes it."""
    model = stack()
    run = wrapped(model, non_reentrant)
    explanation = th.explain(run, stepper(run))
    device = [tensor for tensor in explanation.held if tensor.status != "offloaded"]
    assert sum(tensor.nbytes for tensor in device) == explanation.peak_bytes
    assert sum(row.nbytes for row in explanation.rows()) == explanation.peak_bytes
    assert max(sum(parts) for _, parts in explanation.timeline) <= explanation.peak_bytes
    shares = [share for share, _ in explanation.timeline]
    assert shares == sorted(shares)
    assert 0 <= explanation.backward_at <= 1


def test_attribution_names_modules_and_ops() -> None:
    """Each tensor names the module that saved it and the op that made it, in the model's names."""
    model = stack(blocks=2)
    explanation = th.explain(model, stepper(model))
    found = {(tensor.module, tensor.op, tensor.made_in) for tensor in explanation.held}
    assert ("0.down", "aten.gelu", "0") in found  # GELU's output, saved by the down-projection
    assert ("0.norm", "(input)", "(outside the model)") in found  # the batch
    assert ("(outside the model)", "aten.add", "1") in found  # the loss's square saves the output
    assert explanation.attributed_fraction == 1.0
    assert {tensor.block for tensor in explanation.held} == {"0", "1", None}
    assert all(0 <= tensor.saved_at <= tensor.freed_at <= 1 for tensor in explanation.held)


def test_region_inputs_belong_to_the_region() -> None:
    """A checkpoint's input is shown as the checkpointed module's, not its caller's."""
    model = stack(blocks=2)
    run = wrapped(model, non_reentrant)
    explanation = th.explain(run, stepper(run))
    inputs = {tensor.module for tensor in explanation.held if tensor.kind == "input"}
    assert inputs == {"0.block", "1.block"}


def test_model_hooks_and_state_left_as_they_were() -> None:
    """No hook is left on the model or the thread; gradients and the RNG are put back."""
    model = stack()
    step = stepper(model)
    step()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rng = torch.get_rng_state()
    th.explain(model, step)
    assert top_saved_tensors_hooks() is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_step_that_raises_leaves_no_hook() -> None:
    """A step raising inside a checkpoint region: its error, and no hook or mode left behind."""

    def broken(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def region(x: torch.Tensor) -> torch.Tensor:
            block.up(block.norm(x))
            raise ValueError("inside the region")

        return torch_checkpoint.checkpoint(region, x, use_reentrant=False)

    model = wrapped(stack(), broken)
    with pytest.raises(ValueError, match="inside the region"):
        th.explain(model, stepper(model))
    assert top_saved_tensors_hooks() is None
    assert current_dispatch_mode() is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_pair_in_force_before_the_step_keeps_working() -> None:
    """Explained inside the user's save_on_cpu: its saves are offloaded, and it is back after."""
    model = stack()
    step = stepper(model)
    with torch.autograd.graph.save_on_cpu():
        before = top_saved_tensors_hooks()
        explanation = th.explain(model, step)
        assert top_saved_tensors_hooks() == before
    assert explanation.peak_bytes == 0
    assert explanation.host_peak_bytes > 0


def test_plan_under_the_budget() -> None:
    """With a budget: the cheapest plan under it, which fits when run, and its time in words."""
    model = stack()
    step = stepper(model)
    explanation = th.explain(model, step, 0.5)
    plan = explanation.plan
    assert plan is not None
    assert explanation.budget_bytes == plan.budget_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    text = str(explanation)
    assert "cheapest plan: predicted peak" in text
    assert "against no checkpointing" in text


def test_no_plan_for_a_step_that_checkpoints_itself() -> None:
    """The step checkpoints its blocks itself: no plan, and the note says what to turn off."""
    model = wrapped(stack(), non_reentrant)
    explanation = th.explain(model, stepper(model), 0.5, blocks=[m.block for m in model])
    assert explanation.plan is None
    assert explanation.plan_note is not None
    assert "checkpoints by itself (4 checkpointed regions" in explanation.plan_note
    assert "gradient_checkpointing_disable()" in explanation.plan_note


def test_budget_below_any_plan_is_a_note() -> None:
    """A budget no plan reaches: no plan, and the note names the least peak."""
    model = stack()
    explanation = th.explain(model, stepper(model), 1)
    assert explanation.plan is None
    assert explanation.plan_note is not None
    assert "least peak any plan reaches" in explanation.plan_note


def test_arguments_are_checked_before_the_step_runs() -> None:
    """A wrong model, step or budget raises at once, naming explain, and the step never runs."""
    model = stack()
    ran = []

    def step() -> None:
        ran.append(1)

    with pytest.raises(th.PlanArgumentTypeError, match=r"explain: model must be an nn.Module"):
        th.explain("model", step)  # type: ignore[arg-type]
    with pytest.raises(th.PlanArgumentTypeError, match=r"explain: step must be a function"):
        th.explain(model, "step")  # type: ignore[arg-type]
    with pytest.raises(th.PlanArgumentTypeError, match=r"explain: budget must be an int"):
        th.explain(model, step, [1])  # type: ignore[arg-type]
    with pytest.raises(th.PlanArgumentValueError, match=r"explain: a float budget .* got 1.5"):
        th.explain(model, step, 1.5)
    assert ran == []


def test_table_keeps_to_80_columns() -> None:
    """Every line of the explanation is at most 80 characters but a module's own name."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).train()
    model.activation_checkpointing_enable()
    ids = torch.randint(3, 64, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    explanation = th.explain(model, step, 0.5)
    lines = str(explanation).splitlines()
    assert any("_scaled_dot_product_flash_attention" in line for line in lines)
    names = {row.module for row in explanation.rows()}
    assert all(len(line) <= 80 or line.split("  (")[0] in names for line in lines)
    assert any(line.startswith("no plan: the step checkpoints by itself") for line in lines)


def test_chart_is_drawn(tmp_path: Path) -> None:
    """save_chart writes a PNG image."""
    pytest.importorskip("matplotlib")
    model = stack()
    path = th.explain(model, stepper(model), 0.5).save_chart(tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_peak_and_the_offloaded_bytes() -> None:
    """On a GPU: the planner's unplanned peak; under save_on_cpu, all of it in host memory."""
    model = stack(width=64, hidden=256).cuda()
    x = torch.randn(512, 64, device="cuda", requires_grad=True)

    def step() -> None:
        model(x).square().mean().backward()

    def offloaded() -> None:
        with th.save_on_cpu(pin_memory=True):
            step()

    profile = th.profile_step(model, step, rounds=1)
    explanation = th.explain(model, step)
    assert explanation.device.startswith("cuda")
    assert explanation.peak_bytes == profile.unplanned_peak_bytes
    moved = th.explain(model, offloaded)
    # Tiny tensors (LayerNorm's statistics) stay on the device; the rest is in host memory.
    assert moved.peak_bytes < explanation.peak_bytes / 10
    assert moved.host_peak_bytes > explanation.peak_bytes / 2
