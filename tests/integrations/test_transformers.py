"""tensorhooks.integrations.transformers: checkpoint_layers, and checkpoint_trainer in the Trainer.

Differential throughout: the same tiny model (same weights, same batch, same RNG) trained with
no checkpointing, with transformers' own (torch's checkpoint), and through the integration.
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks
from tensorhooks.integrations.transformers import (
    TrainerCheckpointing,
    checkpoint_layers,
    checkpoint_trainer,
)

from .common import (
    MODELS,
    Recomputations,
    assert_same,
    batch,
    built,
    cache_length,
    grads,
    layers,
    rows,
    transformers,
)


def step_grads(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of one training step on ``inputs``, with ``use_cache=True``."""
    torch.manual_seed(3)  # GPT-2's dropout draws the same numbers in every run
    model(**inputs, use_cache=True).loss.backward()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    return found


# --- checkpoint_layers -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layers_recompute_with_tensorhooks(name: str) -> None:
    """Every layer is recomputed by tensorhooks; gradients are bitwise the unplanned ones."""
    inputs = batch()
    expected = step_grads(built(name), inputs)
    model = built(name)
    checkpoint_layers(model)
    recomputations = Recomputations(model)
    assert_same(step_grads(model, inputs), expected)
    assert recomputations.by_tensorhooks() == [True, True]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_own_switch_recomputes_with_torch(name: str) -> None:
    """The baseline the integration changes: transformers' switch recomputes with torch's."""
    model = built(name)
    model.activation_checkpointing_enable()
    recomputations = Recomputations(model)
    step_grads(model, batch())
    assert recomputations.seen == [[False, False], [False, False]]  # twice each, torch's


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cache_is_handled_as_transformers_does(name: str) -> None:
    """Train mode: no cache is filled, as under transformers' checkpointing; eval: it is."""
    inputs = {key: value for key, value in batch().items() if key != "labels"}
    theirs, ours = built(name), built(name)
    theirs.activation_checkpointing_enable()
    checkpoint_layers(ours)
    for training in (True, False):
        theirs.train(training)
        ours.train(training)
        torch.manual_seed(3)
        expected = theirs(**inputs, use_cache=True)
        torch.manual_seed(3)
        output = ours(**inputs, use_cache=True)
        assert cache_length(output) == cache_length(expected) == (0 if training else 16)
        assert torch.equal(output.logits, expected.logits)


def test_every_n_layers_checkpoints_those_layers_only() -> None:
    """every_n_layers=2 checkpoints the first of each two layers, as transformers' option."""
    model = built("llama")
    checkpoint_layers(model, every_n_layers=2)
    recomputations = Recomputations(model)
    step_grads(model, batch())
    assert recomputations.seen == [[False, True], [False]]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_offload_keeps_the_gradients(name: str) -> None:
    """offload=True (inputs through save_on_cpu) gives the unplanned gradients, recomputed."""
    inputs = batch()
    expected = step_grads(built(name), inputs)
    model = built(name)
    checkpoint_layers(model, offload=True)
    recomputations = Recomputations(model)
    assert_same(step_grads(model, inputs), expected)
    assert recomputations.by_tensorhooks() == [True, True]


def test_checkpoint_options_reach_every_layer() -> None:
    """A context_fn given to checkpoint_layers is the one each layer's checkpoint runs."""
    asked: list[object] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tensorhooks.CheckpointPolicy:
        asked.append(op)
        return tensorhooks.CheckpointPolicy.PREFER_RECOMPUTE

    inputs = batch()
    expected = step_grads(built("llama"), inputs)
    model = built("llama")
    context_fn = functools.partial(tensorhooks.create_selective_checkpoint_contexts, policy)
    checkpoint_layers(model, context_fn=context_fn, use_reentrant=False)
    assert_same(step_grads(model, inputs), expected)
    assert torch.ops.aten.mm.default in asked


def test_no_use_reentrant_warning() -> None:
    """checkpoint_layers warns nothing; the recipe it replaces warned at every layer call."""
    model = built("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint_layers(model)
        step_grads(model, batch())
    assert [str(warning.message) for warning in caught] == []
    old = built("llama")  # the private-method recipe: tensorhooks.checkpoint, use_reentrant unset
    old._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=tensorhooks.checkpoint)
    with pytest.warns(UserWarning, match="use_reentrant"):
        step_grads(old, batch())


def test_a_copy_of_the_model_checkpoints_too() -> None:
    """copy.deepcopy of a model set up by checkpoint_layers trains the same, recomputed."""
    inputs = batch()
    expected = step_grads(built("gpt2"), inputs)
    model = built("gpt2")
    checkpoint_layers(model, offload=True)
    copied = copy.deepcopy(model)
    recomputations = Recomputations(copied)
    assert_same(step_grads(copied, inputs), expected)
    assert recomputations.by_tensorhooks() == [True, True]


def test_checkpoint_layers_refusals() -> None:
    """Options the checkpoint does not take, and models it cannot switch, are refused by name."""
    model = built("llama")
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="use_reentrant=True"):
        checkpoint_layers(model, use_reentrant=True)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=r"\['reentrant'\] are not"):
        checkpoint_layers(model, reentrant=False)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="every_n_layers must"):
        checkpoint_layers(model, every_n_layers=0)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="offload must be a bool"):
        checkpoint_layers(model, offload="yes")  # type: ignore[arg-type]
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match="not a transformers model"):
        checkpoint_layers(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert not model.is_activation_checkpointing  # nothing was switched on by a refused call


def test_layers_wrapped_by_torchs_checkpoint_wrapper_are_refused() -> None:
    """A layer inside torch's checkpoint_wrapper (FSDP's option) would be checkpointed twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = built("llama")
    inner: Any = model
    inner.model.layers[0] = checkpoint_wrapper(inner.model.layers[0])
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=r"layers\.0 is wrapped"):
        checkpoint_layers(model)


# --- checkpoint_trainer ----------------------------------------------------------------------


class FirstGrads(transformers.TrainerCallback):  # type: ignore[misc]
    """The gradients the first optimizer step of a training run is given."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.grads is None:
            self.grads = grads(kwargs["model"])


def trainer(model: nn.Module | None, tmp_path: Path, **arguments: Any) -> Any:
    """A Trainer on 8 rows, batches of 4, two steps, nothing saved or printed as it goes.

    Without a model, its ``model_init`` builds a new Llama for each ``train()``.
    """
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        **arguments,
    )  # fmt: skip
    init = None if model is not None else (lambda *args: built("llama"))
    return transformers.Trainer(model=model, args=args, train_dataset=rows(), model_init=init)


def trained(name: str, tmp_path: Path, **arguments: Any) -> list[torch.Tensor]:
    """The first step's gradients of a Trainer run with no checkpointing at all."""
    run = trainer(built(name), tmp_path, **arguments)
    first = FirstGrads()
    run.add_callback(first)
    run.train()
    assert first.grads is not None
    return first.grads


def test_trainer_setup_puts_torchs_checkpoint_back(tmp_path: Path) -> None:
    """The problem: checkpoint_layers, then Trainer(activation_checkpointing=True): torch's."""
    model = built("llama")
    checkpoint_layers(model)
    run = trainer(model, tmp_path, activation_checkpointing=True)
    recomputations = Recomputations(model)
    run.train()
    assert recomputations.by_tensorhooks() == [False, False]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("switched_on", [True, False])
def test_checkpoint_trainer_survives_the_setup(
    name: str, switched_on: bool, tmp_path: Path
) -> None:
    """With or without the Trainer's own switch: tensorhooks recomputes, same gradients."""
    expected = trained(name, tmp_path)
    model = built(name)
    run = trainer(model, tmp_path, activation_checkpointing=switched_on)
    callback = checkpoint_trainer(run)
    first = FirstGrads()
    run.add_callback(first)
    recomputations = Recomputations(model)
    run.train()
    assert recomputations.by_tensorhooks() == [True, True]
    assert first.grads is not None
    assert_same(first.grads, expected)
    assert isinstance(callback, TrainerCheckpointing)
    assert callback.plan is None


def test_checkpoint_trainer_keeps_the_cache_rules(tmp_path: Path) -> None:
    """After training: eval mode fills the cache, train mode with grad does not."""
    model = built("llama")
    run = trainer(model, tmp_path, activation_checkpointing=True)
    checkpoint_trainer(run)
    run.train()
    inputs = {key: value for key, value in batch().items() if key != "labels"}
    assert cache_length(model.train()(**inputs, use_cache=True)) == 0
    assert cache_length(model.eval()(**inputs, use_cache=True)) == 16


def test_checkpoint_trainer_honours_the_trainers_options(tmp_path: Path) -> None:
    """TrainingArguments' every_n_layers and offload apply to tensorhooks' checkpoint."""
    expected = trained("llama", tmp_path)
    model = built("llama")
    options = {"every_n_layers": 2, "offload": True, "use_reentrant": False}
    run = trainer(model, tmp_path, activation_checkpointing=True, **_kwargs(options))
    checkpoint_trainer(run)
    first = FirstGrads()
    run.add_callback(first)
    recomputations = Recomputations(model)
    run.train()
    assert recomputations.by_tensorhooks() == [True, False]
    assert first.grads is not None
    assert_same(first.grads, expected)


def _kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {"activation_checkpointing_kwargs": options}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_trainer_plans_the_first_step(name: str, tmp_path: Path) -> None:
    """A budget: planned at the first step, the budget holds, the gradients are unchanged."""
    expected = trained(name, tmp_path)
    model = built(name)
    run = trainer(model, tmp_path, activation_checkpointing=True)  # turned off for the plan
    callback = checkpoint_trainer(run, budget=0.6)
    first = FirstGrads()
    run.add_callback(first)
    recomputations = Recomputations(model)
    run.train()
    plan = callback.plan
    assert plan is not None
    assert first.grads is not None
    assert_same(first.grads, expected)
    checkpointed = [block.checkpoint for block in plan.blocks]
    assert any(checkpointed)
    # Profiling recomputes every block; the planned steps, those the plan checkpoints.
    ran = recomputations.by_tensorhooks()
    assert all(ran[index] for index, chosen in enumerate(checkpointed) if chosen)
    assert not model.is_activation_checkpointing
    assert all("forward" not in layer.__dict__ for layer in layers(model))  # removed at the end
    report = plan.report(rounds=1)  # one more Trainer step on the first batch, measured
    assert report.measured_peak_bytes <= plan.budget_bytes


def test_checkpoint_trainer_takes_a_budget_with_units(tmp_path: Path) -> None:
    """A budget as a size string is the planner's: "1GB" is 10**9 bytes, every layer kept."""
    model = built("gpt2")
    run = trainer(model, tmp_path)
    callback = checkpoint_trainer(run, budget="1GB")
    run.train()
    assert callback.plan is not None
    assert callback.plan.budget_bytes == 10**9
    assert not any(block.checkpoint for block in callback.plan.blocks)


def test_a_second_train_call_reuses_the_plan(tmp_path: Path) -> None:
    """train() again: the plan made at the first step applies again, nothing is replanned."""
    model = built("llama")
    run = trainer(model, tmp_path, activation_checkpointing=True)
    callback = checkpoint_trainer(run, budget=0.6)
    run.train()
    plan = callback.plan
    recomputations = Recomputations(model)
    run.train()
    assert callback.plan is plan
    assert plan is not None
    assert recomputations.by_tensorhooks() == [block.checkpoint for block in plan.blocks]


def test_a_new_model_from_model_init_is_planned_anew(tmp_path: Path) -> None:
    """model_init gives each train() a new model: each is planned, and trains under its plan."""
    watched: list[Recomputations] = []

    def model_init(*args: Any) -> nn.Module:
        model = built("llama")
        watched.append(Recomputations(model))
        return model

    run = trainer(None, tmp_path, activation_checkpointing=True)
    run.model_init = model_init
    callback = checkpoint_trainer(run, budget=0.6)
    plans = []
    for _ in range(2):
        run.train()
        plans.append(callback.plan)
    assert plans[0] is not None
    assert plans[1] is not None
    assert plans[0] is not plans[1]
    checkpointed = [block.checkpoint for block in plans[1].blocks]
    assert any(checkpointed)
    ran = watched[-1].by_tensorhooks()  # the model of the second train()
    assert all(ran[index] for index, chosen in enumerate(checkpointed) if chosen)


def test_checkpoint_trainer_refusals(tmp_path: Path) -> None:
    """Wrong types, reentrant options and options beside a budget are refused at the call."""
    model = built("llama")
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match=r"transformers\.Trainer"):
        checkpoint_trainer(model)
    with pytest.raises(tensorhooks.PlanArgumentTypeError, match="budget must be bytes"):
        checkpoint_trainer(trainer(model, tmp_path), budget=[1])  # type: ignore[arg-type]
    reentrant = trainer(model, tmp_path, **_kwargs({"use_reentrant": True}))
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="use_reentrant=True"):
        checkpoint_trainer(reentrant)
    every_second = trainer(model, tmp_path, **_kwargs({"every_n_layers": 2}))
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="the plan chooses"):
        checkpoint_trainer(every_second, budget=0.5)
