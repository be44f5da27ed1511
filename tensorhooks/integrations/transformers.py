"""Hugging Face transformers on tensorhooks: a model's layers, and the Trainer, in one call each.

- `checkpoint_layers` makes a model's layers checkpoint with `tensorhooks.checkpoint`, through
  transformers' own switch: the layers it picks (``every_n_layers``), the KV cache turned off
  in training and kept in evaluation, as transformers does.
- `checkpoint_trainer` does it for a ``transformers.Trainer`` after the Trainer's own setup
  (which puts torch's checkpoint back), or, given a budget, plans the layers with
  `tensorhooks.plan_activations` from the first training step.

See docs/integrations.md. Needs transformers 5.24 or later (``pip install transformers``).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover (the test extra installs it)
    raise ImportError(
        "tensorhooks.integrations.transformers needs transformers; install it with "
        "`pip install 'transformers>=5.24'`"
    ) from error

from tensorhooks import ActivationPlan, CheckpointArgumentTypeError, CheckpointArgumentValueError

from ._first_step import FirstStepPlan, check_budget
from ._layers import (
    NO_OP,
    hf_checkpointing_on,
    layer_checkpoint,
    refuse_torch_wrappers,
    switch_off,
    switch_on,
    use_function,
)

__all__ = ["TrainerCheckpointing", "checkpoint_layers", "checkpoint_trainer"]


def checkpoint_layers(
    model: nn.Module,
    *,
    every_n_layers: int = 1,
    offload: bool = False,
    **checkpoint_kwargs: Any,
) -> None:
    """Make a transformers model's layers checkpoint with `tensorhooks.checkpoint`.

    What ``model.activation_checkpointing_enable()`` does, with tensorhooks' non-reentrant
    checkpoint in place of torch's: in train mode with grad enabled each chosen layer runs
    inside `tensorhooks.checkpoint` (``torch.autograd.grad`` works, nothing warns about
    ``use_reentrant``) with its KV cache off (``use_cache=False``), and in eval mode or under
    ``no_grad`` it runs as it is, cache included. ``model.activation_checkpointing_disable()``
    turns it off. A ``transformers.Trainer`` puts torch's checkpoint back when it sets the
    model up (``TrainingArguments(activation_checkpointing=True)``): use `checkpoint_trainer`
    there.

    Example:
        >>> import torch, transformers
        >>> from tensorhooks.integrations.transformers import checkpoint_layers
        >>> config = transformers.LlamaConfig(
        ...     hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> checkpoint_layers(model)
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(input_ids=ids, labels=ids).loss.backward()

    Args:
        model: a transformers model (``supports_gradient_checkpointing``).
        every_n_layers: checkpoint every n-th layer only, as transformers' own option.
        offload: keep the checkpointed layers' inputs in host memory (`tensorhooks.save_on_cpu`,
            pinned where CUDA is available), as transformers' ``offload=True``.
        **checkpoint_kwargs: options of `tensorhooks.checkpoint` for every layer
            (``context_fn``, ``preserve_rng_state``, ``determinism_check``, ``debug``,
            ``early_stop``); ``use_reentrant`` may be False only.

    Raises:
        CheckpointArgumentTypeError: if ``model`` is not a transformers model with
            ``activation_checkpointing_enable`` (a ``TypeError``).
        CheckpointArgumentValueError: if the model does not support checkpointing, is wrapped
            by torch's ``checkpoint_wrapper`` already, or an option is not one
            `tensorhooks.checkpoint` takes (``use_reentrant=True`` included) (a
            ``ValueError``).
    """
    function = layer_checkpoint(checkpoint_kwargs, offload, "checkpoint_layers")
    if isinstance(model, nn.Module):
        refuse_torch_wrappers(model, "checkpoint_layers")
    switch_on(model, every_n_layers, "checkpoint_layers")
    use_function(model, function, "checkpoint_layers")


def checkpoint_trainer(
    trainer: Any, *, budget: int | float | str | None = None
) -> TrainerCheckpointing:
    """Train with tensorhooks' checkpoint, or a plan under ``budget``, from a Trainer.

    Call it once, after making the ``transformers.Trainer`` and before ``trainer.train()``. It
    adds a `TrainerCheckpointing` callback, which acts when training begins, after the
    Trainer's own setup:

    - ``budget=None``: every layer checkpoints with `tensorhooks.checkpoint`, as
      `checkpoint_layers` (whether ``TrainingArguments(activation_checkpointing=...)`` is on or
      not); the Trainer's ``activation_checkpointing_kwargs`` keep their meaning
      (``every_n_layers``, ``offload``, and the checkpoint's options);
    - a budget (bytes, a fraction of the unplanned peak, or a size such as ``"8GB"``): the first
      training step is planned with `tensorhooks.plan_activations` (the Trainer's own
      ``training_step``, run several times, on that step's batch), and every step from then on
      runs under the plan (`TrainerCheckpointing.plan`) until training ends. transformers' own
      checkpointing is turned off: the plan checkpoints the layers it chooses.

    Example:
        >>> import tempfile, torch, transformers
        >>> from tensorhooks.integrations.transformers import checkpoint_trainer
        >>> config = transformers.LlamaConfig(
        ...     hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> rows = torch.randint(0, 64, (8, 16))
        >>> data = [{"input_ids": row, "labels": row} for row in rows]
        >>> args = transformers.TrainingArguments(
        ...     tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
        ...     activation_checkpointing=True, report_to=[], save_strategy="no", use_cpu=True,
        ...     disable_tqdm=True)
        >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        >>> planned = checkpoint_trainer(trainer, budget=0.7)
        >>> _ = trainer.train()  # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> planned.plan.budget_bytes > 0
        True

    Args:
        trainer: the ``transformers.Trainer`` (or a subclass).
        budget: None to checkpoint every layer; else the plan's budget, as
            `tensorhooks.plan_activations` takes it.

    Returns:
        The `TrainerCheckpointing` callback added to the trainer.

    Raises:
        CheckpointArgumentTypeError: if ``trainer`` is not a ``transformers.Trainer`` (a
            ``TypeError``).
        CheckpointArgumentValueError: if the Trainer's ``activation_checkpointing_kwargs``
            name an option `tensorhooks.checkpoint` does not take (``use_reentrant=True``
            included), or any option at all with a budget (the plan chooses) (a
            ``ValueError``).
        PlanArgumentTypeError: if ``budget`` is neither None, an int, a float nor a str (a
            ``TypeError``).
    """
    from transformers import Trainer  # noqa: PLC0415  # a large module: imported when used

    if not isinstance(trainer, Trainer):
        raise CheckpointArgumentTypeError(
            f"checkpoint_trainer: trainer must be a transformers.Trainer, got {trainer!r} of "
            f"type {type(trainer).__name__}; for a model, call checkpoint_layers(model)"
        )
    callback = TrainerCheckpointing(trainer, budget)
    trainer.add_callback(callback)
    return callback


def _trainer_options(args: Any, budget: object) -> tuple[int, bool, dict[str, Any]]:
    """``every_n_layers``, ``offload`` and the checkpoint's options from ``TrainingArguments``.

    Raises:
        CheckpointArgumentValueError: with a budget, if any option is given (the plan chooses).
    """
    options = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    every_n_layers = options.pop("every_n_layers", 1)
    offload = options.pop("offload", False)
    if budget is not None:
        given = [name for name, value in options.items() if (name, value) != NO_OP]
        given += ["every_n_layers"] * (every_n_layers != 1) + ["offload"] * bool(offload)
        if given:
            raise CheckpointArgumentValueError(
                f"checkpoint_trainer: TrainingArguments(activation_checkpointing_kwargs=...) "
                f"sets {given}, but with a budget the plan chooses which layers to checkpoint "
                "and how; leave them out, or pass budget=None to checkpoint every layer with "
                "them"
            )
    return every_n_layers, offload, options


class TrainerCheckpointing(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """The callback `checkpoint_trainer` adds; ``plan`` is the plan made at the first step.

    ``on_train_begin`` (after the Trainer's setup) puts tensorhooks' checkpoint in the layers,
    or, with a budget, turns transformers' checkpointing off and applies the plan if it was made
    already (a second ``train()``); ``on_train_end`` takes the plan off the blocks. With a
    budget it also stands in for ``trainer.training_step``, to plan from the first step.

    Example:
        >>> import tempfile, transformers
        >>> from tensorhooks.integrations.transformers import checkpoint_trainer
        >>> config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
        >>> trainer = transformers.Trainer(transformers.GPT2LMHeadModel(config), args)
        >>> callback = checkpoint_trainer(trainer)  # no budget: every layer, no plan
        >>> callback in trainer.callback_handler.callbacks, callback.plan
        (True, None)
    """

    def __init__(self, trainer: Any, budget: int | float | str | None) -> None:
        if budget is not None:
            check_budget(budget, "checkpoint_trainer")
        # Checked now, and read again when training begins (the arguments may change between).
        _, offload, options = _trainer_options(trainer.args, budget)
        if budget is None:
            layer_checkpoint(options, offload, "checkpoint_trainer")
        self._trainer = trainer
        self._first = None if budget is None else FirstStepPlan(budget, "checkpoint_trainer")
        self._training_step = trainer.training_step
        if budget is not None:
            trainer.training_step = self._planning_step

    @property
    def plan(self) -> ActivationPlan | None:
        """The plan made from the first training step (with a budget); None before it."""
        return None if self._first is None else self._first.plan

    def _model(self) -> nn.Module:
        model: nn.Module = self._trainer.accelerator.unwrap_model(self._trainer.model)
        return model

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the Trainer's setup: tensorhooks' checkpoint in the layers, or the plan."""
        model = self._model()
        refuse_torch_wrappers(model, "checkpoint_trainer")
        if self._first is None:
            self._use_checkpoint(model, args)
        else:
            self._use_plan(model, args, self._first)

    def _use_checkpoint(self, model: nn.Module, args: Any) -> None:
        every_n_layers, offload, options = _trainer_options(args, None)
        function = layer_checkpoint(options, offload, "checkpoint_trainer")
        if not hf_checkpointing_on(model):  # else the Trainer switched it on, with its options
            switch_on(model, every_n_layers, "checkpoint_trainer")
        use_function(model, function, "checkpoint_trainer")

    def _use_plan(self, model: nn.Module, args: Any, first: FirstStepPlan) -> None:
        _trainer_options(args, first.budget)
        if hf_checkpointing_on(model):
            switch_off(model)  # the plan checkpoints the layers it chooses
        if first.model is not None and first.model is not model:
            # A new model (the Trainer's model_init): planned at its own first step.
            first = self._first = FirstStepPlan(first.budget, "checkpoint_trainer")
        first.apply()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Take the plan off the blocks: evaluation and inference after training run plain."""
        if self._first is not None:
            self._first.remove()

    def _planning_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``trainer.training_step``, planning the first step before running it."""
        first = self._first
        assert first is not None
        if not first.applied:
            step = functools.partial(self._training_step, model, inputs, *args, **kwargs)
            # No gradient all-reduce while planning: each process plans its own step, and ranks
            # may profile different numbers of steps.
            with self._trainer.accelerator.no_sync(model):
                first.plan_and_apply(self._model(), step)
        return self._training_step(model, inputs, *args, **kwargs)
