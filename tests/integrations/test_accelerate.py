"""tensorhooks.integrations.accelerate: checkpoint_model after accelerator.prepare.

Each test runs an Accelerator on the CPU (one process) against the same loop without the call:
same weights, batches and RNG, so gradients and parameters must match bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks
from tensorhooks.integrations.accelerate import ModelCheckpointing, checkpoint_model

from .common import MODELS, Recomputations, assert_same, batch, built, grads, layers

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Iterator[None]:
    """The Accelerator keeps its state (gradient accumulation steps among it) process-wide."""
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def prepared(name: str, steps: int = 1) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """A CPU Accelerator, accumulating over ``steps`` micro-batches, and what it prepared."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
    model = built(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(
    accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int
) -> list[torch.Tensor]:
    """The usual accelerate loop; the gradients at the first optimizer step."""
    first: list[torch.Tensor] = []
    torch.manual_seed(3)
    for index in range(micro_batches):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(seed=index)).loss)
            if accelerator.sync_gradients and not first:
                first = grads(model)
            optimizer.step()
            optimizer.zero_grad()
    return first


def reference(name: str, steps: int = 1, micro_batches: int = 2) -> list[torch.Tensor]:
    """The same loop without tensorhooks: the first step's gradients, and the weights after."""
    accelerator, model, optimizer = prepared(name, steps)
    first = train(accelerator, model, optimizer, micro_batches)
    return first + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layers_recompute_with_tensorhooks(name: str) -> None:
    """No budget: the layers are recomputed by tensorhooks; gradients and weights unchanged."""
    expected = reference(name)
    accelerator, model, optimizer = prepared(name)
    checkpointing = checkpoint_model(accelerator, model)
    recomputations = Recomputations(model)
    first = train(accelerator, model, optimizer, 2)
    assert_same(first + [p.detach() for p in model.parameters()], expected)
    assert recomputations.by_tensorhooks() == [True, True]
    assert isinstance(checkpointing, ModelCheckpointing)
    assert checkpointing.plan is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_budget_plans_the_first_training_call(name: str) -> None:
    """A budget: planned at the first training call, with accumulation; the budget holds."""
    expected = reference(name, steps=2, micro_batches=4)
    accelerator, model, optimizer = prepared(name, steps=2)
    checkpointing = checkpoint_model(accelerator, model, budget=0.6)
    first = train(accelerator, model, optimizer, 4)
    assert_same(first + [p.detach() for p in model.parameters()], expected)
    plan = checkpointing.plan
    assert plan is not None
    assert any(block.checkpoint for block in plan.blocks)
    recomputations = Recomputations(model)
    train(accelerator, model, optimizer, 1)  # planned before: runs under the plan
    assert recomputations.by_tensorhooks() == [block.checkpoint for block in plan.blocks]
    checkpointing.remove()
    report = plan.report(rounds=1)  # the planned step once more (first micro-batch), measured
    assert report.measured_peak_bytes <= plan.budget_bytes


def test_no_plan_outside_training() -> None:
    """Calls under no_grad or in eval mode plan nothing; the first training call does."""
    accelerator, model, _ = prepared("llama")
    checkpointing = checkpoint_model(accelerator, model, budget=0.6)
    with torch.no_grad():
        model(**batch())
    model.eval()
    model(**batch()).loss.backward()
    assert checkpointing.plan is None
    model.train()
    model(**batch()).loss.backward()
    assert checkpointing.plan is not None
    checkpointing.remove()


def test_the_loss_comes_from_the_output_or_from_loss() -> None:
    """Without labels there is no loss to plan with; loss= gives one."""
    inputs = {key: value for key, value in batch().items() if key != "labels"}
    accelerator, model, _ = prepared("gpt2")
    checkpoint_model(accelerator, model, budget=0.6)
    with pytest.raises(tensorhooks.PlanArgumentValueError, match="returned no loss"):
        model(**inputs)
    accelerator, model, _ = prepared("gpt2")
    checkpointing = checkpoint_model(
        accelerator, model, budget=0.6, loss=lambda output: output.logits.square().mean()
    )
    model(**inputs)
    assert checkpointing.plan is not None
    checkpointing.remove()


def test_transformers_own_checkpointing_gives_way_to_the_plan() -> None:
    """Switched on before prepare: a budget turns transformers' checkpointing off to plan."""
    accelerator, model, optimizer = prepared("llama")
    inner: Any = model
    inner.activation_checkpointing_enable()
    checkpointing = checkpoint_model(accelerator, model, budget=0.6)
    assert not inner.is_activation_checkpointing
    train(accelerator, model, optimizer, 1)
    assert checkpointing.plan is not None
    checkpointing.remove()


def test_remove_undoes_the_call() -> None:
    """remove(): the blocks run their own forward again, and no later call plans."""
    accelerator, model, _ = prepared("llama")
    checkpointing = checkpoint_model(accelerator, model, budget=0.6)
    model(**batch()).loss.backward()
    assert all("forward" in layer.__dict__ for layer in layers(model))
    checkpointing.remove()
    assert all("forward" not in layer.__dict__ for layer in layers(model))
    unplanned = checkpoint_model(accelerator, model, budget=0.6)
    unplanned.remove()
    model(**batch()).loss.backward()
    assert unplanned.plan is None
    plain = checkpoint_model(accelerator, model)
    assert model.is_activation_checkpointing
    plain.remove()
    assert not model.is_activation_checkpointing


def test_checkpoint_model_refusals() -> None:
    """A wrong accelerator, options beside a budget, and a plain model without one."""
    accelerator, model, _ = prepared("llama")
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match=r"accelerate\.Accelerator"):
        checkpoint_model(model, model)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=r"\['every_n_layers'\]"):
        checkpoint_model(accelerator, model, budget=0.5, every_n_layers=2)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="use_reentrant=True"):
        checkpoint_model(accelerator, model, use_reentrant=True)
    plain = accelerator.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match="plan_activations"):
        checkpoint_model(accelerator, plain)
    with pytest.raises(tensorhooks.PlanArgumentTypeError, match="budget must be bytes"):
        checkpoint_model(accelerator, model, budget=b"8GB")  # type: ignore[arg-type]
