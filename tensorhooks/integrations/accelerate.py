"""accelerate on tensorhooks: one call after ``accelerator.prepare(...)``.

`checkpoint_model` makes a prepared transformers model's layers checkpoint with
`tensorhooks.checkpoint`, or, given a budget, plans the model's blocks with
`tensorhooks.plan_activations` at its first training forward, and trains under the plan from
then on. See docs/integrations.md.

Nothing here imports accelerate: the accelerator is asked for what it does
(``unwrap_model``, ``backward``, ``no_sync``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorhooks import (
    ActivationPlan,
    CheckpointArgumentTypeError,
    CheckpointArgumentValueError,
    PlanArgumentValueError,
    PlanStateError,
)

from ._first_step import FirstStepPlan
from ._layers import (
    NO_OP,
    hf_checkpointing_on,
    layer_checkpoint,
    refuse_torch_wrappers,
    switch_off,
    switch_on,
    use_function,
)

__all__ = ["ModelCheckpointing", "checkpoint_model"]

LossFn = Callable[[Any], torch.Tensor]


def checkpoint_model(
    accelerator: Any,
    model: nn.Module,
    *,
    budget: int | float | str | None = None,
    loss: LossFn | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
    **checkpoint_kwargs: Any,
) -> ModelCheckpointing:
    """Train a prepared model with tensorhooks' checkpoint, or under a plan within ``budget``.

    Call it once, after ``accelerator.prepare(...)``, with the model it returned; the training
    loop stays as it is.

    - ``budget=None``: the layers of the (unwrapped) transformers model checkpoint with
      `tensorhooks.checkpoint`, as `tensorhooks.integrations.transformers.checkpoint_layers`
      with ``every_n_layers``, ``offload`` and the checkpoint's options.
    - a budget (bytes, a fraction of the unplanned peak, or a size such as ``"8GB"``): the model
      is planned with `tensorhooks.plan_activations` when it is first called in train mode with
      grad enabled, before that call runs: the step planned is that call's forward on the same
      arguments, ``loss`` of its output, and ``accelerator.backward``. Every call from then on
      runs under the plan (`ModelCheckpointing.plan`). Any model with repeated blocks plans;
      transformers' own checkpointing, if on, is turned off (the plan checkpoints).

    Example:
        >>> import accelerate, torch, transformers
        >>> from tensorhooks.integrations.accelerate import checkpoint_model
        >>> config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)
        >>> accelerator = accelerate.Accelerator(cpu=True)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> planned = checkpoint_model(accelerator, model, budget=0.7)
        >>> ids = torch.randint(0, 64, (4, 16))
        >>> accelerator.backward(model(input_ids=ids, labels=ids).loss)  # planned, then run
        >>> planned.plan.budget_bytes > 0
        True
        >>> planned.remove()

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the model ``accelerator.prepare`` returned.
        budget: None to checkpoint every layer; else the plan's budget, as
            `tensorhooks.plan_activations` takes it.
        loss: with a budget, the loss from the model's output, for the planned step; default:
            the output itself if it is a tensor, its ``"loss"`` (transformers models given
            labels), or its first item.
        every_n_layers: without a budget, checkpoint every n-th layer only.
        offload: without a budget, keep the checkpointed layers' inputs in host memory.
        **checkpoint_kwargs: without a budget, options of `tensorhooks.checkpoint` for every
            layer.

    Returns:
        A `ModelCheckpointing`: its ``plan``, and ``remove()``.

    Raises:
        CheckpointArgumentTypeError: if ``accelerator`` has no ``unwrap_model``, or without a
            budget ``model`` is not a transformers model (a ``TypeError``).
        CheckpointArgumentValueError: if the model is wrapped by torch's ``checkpoint_wrapper``
            (FSDP's ``activation_checkpointing``), or an option is not one
            `tensorhooks.checkpoint` takes, or is given with a budget (a ``ValueError``).
        PlanArgumentTypeError: if ``budget`` is neither None, an int, a float nor a str (a
            ``TypeError``).
        PlanArgumentValueError: at the first training call, if ``loss`` is left out and the
            output holds no loss (a ``ValueError``).
    """
    if not callable(getattr(accelerator, "unwrap_model", None)):
        raise CheckpointArgumentTypeError(
            f"checkpoint_model: accelerator must be the accelerate.Accelerator that prepared "
            f"the model, got {accelerator!r} of type {type(accelerator).__name__}"
        )
    unwrapped: nn.Module = accelerator.unwrap_model(model)
    refuse_torch_wrappers(unwrapped, "checkpoint_model")
    if budget is None:
        function = layer_checkpoint(checkpoint_kwargs, offload, "checkpoint_model")
        switch_on(unwrapped, every_n_layers, "checkpoint_model")
        use_function(unwrapped, function, "checkpoint_model")
        return ModelCheckpointing(accelerator, model, None, None)
    given = [name for name, value in checkpoint_kwargs.items() if (name, value) != NO_OP]
    given += ["every_n_layers"] * (every_n_layers != 1) + ["offload"] * (offload is not False)
    if given:
        raise CheckpointArgumentValueError(
            f"checkpoint_model: {given} are options for checkpointing every layer, but with a "
            "budget the plan chooses which layers to checkpoint and how; leave them out, or "
            "pass budget=None"
        )
    return ModelCheckpointing(accelerator, model, FirstStepPlan(budget, "checkpoint_model"), loss)


def default_loss(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself, its ``"loss"``, or its first item.

    Raises:
        PlanArgumentValueError: if none of them is a tensor.
    """
    value = output
    if isinstance(output, Mapping):  # transformers' ModelOutput is an ordered dict
        value = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        value = output[0]
    if not isinstance(value, torch.Tensor):
        raise PlanArgumentValueError(
            f"checkpoint_model: the model's first training call returned no loss (a "
            f"{type(output).__name__} whose loss is {type(value).__name__}), so there is no "
            "step to plan; call the model with its labels, or pass loss=lambda output: ... "
            "that computes the loss from the output"
        )
    return value


class ModelCheckpointing:
    """What `checkpoint_model` set up on a prepared model; ``remove()`` undoes it.

    Without a budget the layers checkpoint with tensorhooks' checkpoint until ``remove()``
    (``activation_checkpointing_disable()``). With one, a forward pre-hook plans the model at
    its first training call; the plan stays applied until ``remove()``.

    Example:
        >>> import accelerate, torch, transformers
        >>> from tensorhooks.integrations.accelerate import checkpoint_model
        >>> config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)
        >>> accelerator = accelerate.Accelerator(cpu=True)
        >>> model = accelerator.prepare(transformers.GPT2LMHeadModel(config))
        >>> checkpointing = checkpoint_model(accelerator, model)  # no budget: every layer
        >>> model.is_activation_checkpointing, checkpointing.plan
        (True, None)
        >>> checkpointing.remove()
        >>> model.is_activation_checkpointing
        False

    Nesting and threads: the plan, once made, applies on every thread; plan the model from one.
    """

    def __init__(
        self, accelerator: Any, model: nn.Module, first: FirstStepPlan | None, loss: LossFn | None
    ) -> None:
        self._accelerator = accelerator
        self._unwrapped: nn.Module = accelerator.unwrap_model(model)
        self._first = first
        self._loss = default_loss if loss is None else loss
        self._planning = False
        self._no_loss: PlanArgumentValueError | None = None
        self._hook: RemovableHandle | None = None
        if first is not None:
            if hf_checkpointing_on(self._unwrapped):
                switch_off(self._unwrapped)  # the plan checkpoints the layers it chooses
            self._hook = model.register_forward_pre_hook(self._first_call, with_kwargs=True)

    @property
    def plan(self) -> ActivationPlan | None:
        """The plan made at the first training call (with a budget); None before it."""
        return None if self._first is None else self._first.plan

    def _first_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = self._first
        if first is None or self._planning or not module.training or not torch.is_grad_enabled():
            return
        self._planning = True
        try:
            step = functools.partial(self._step, module, args, kwargs)
            # No gradient all-reduce while planning: each process plans its own step, and ranks
            # may profile different numbers of steps.
            with self._accelerator.no_sync(module):
                first.plan_and_apply(self._unwrapped, step)
        except PlanStateError:
            # The planner reports a step that raised before its backward as one that ran no
            # backward; a missing loss is the cause, so that is what is raised.
            if self._no_loss is not None:
                raise self._no_loss from None
            raise
        finally:
            self._planning = False
            self._no_loss = None
        self._remove_hook()

    def _step(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        output = module(*args, **kwargs)
        try:
            loss = self._loss(output)
        except PlanArgumentValueError as error:
            self._no_loss = error
            raise
        self._accelerator.backward(loss)

    def _remove_hook(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    def remove(self) -> None:
        """Take the plan off the model (or, without a budget, turn checkpointing off)."""
        self._remove_hook()
        if self._first is not None:
            self._first.remove()
        elif hf_checkpointing_on(self._unwrapped):
            switch_off(self._unwrapped)
