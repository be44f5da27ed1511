"""Hugging Face layers checkpointed by `tensorhooks.checkpoint`, through transformers' switch.

See NOTE [Hugging Face's checkpoint switch]. Nothing here imports transformers: a model is
recognised by what it has (``activation_checkpointing_enable``, the layers'
``gradient_checkpointing`` flags), so the accelerate integration works without importing it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tensorhooks import (
    CheckpointArgumentTypeError,
    CheckpointArgumentValueError,
    checkpoint,
    save_on_cpu,
)

__all__ = [
    "NO_OP",
    "LayerCheckpoint",
    "hf_checkpointing_on",
    "layer_checkpoint",
    "refuse_torch_wrappers",
    "switch_off",
    "switch_on",
    "use_function",
]

# NOTE [Hugging Face's checkpoint switch]
#
# transformers checkpoints a model layer by layer. `model.activation_checkpointing_enable()`
# (transformers 5.24; `gradient_checkpointing_enable()` is its deprecated alias) sets
# `gradient_checkpointing = True` on the modules that carry the flag (each decoder layer, a
# `GradientCheckpointingLayer`, and the stacks of some models, GPT-2's) and stores in their
# `_gradient_checkpointing_func` the checkpoint function: `functools.partial(checkpoint,
# use_reentrant=False)`, where `checkpoint` is torch's, bound in transformers.modeling_utils;
# no argument passes another. In train mode with grad enabled a layer's `forward` then turns its
# KV cache off (`use_cache=False`, `cache=None`: a recomputation would write it again) and calls
# `self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`; module hooks
# stay outside the region (FSDP2's among them). In eval mode, or without grad, the layer runs as
# it is, cache included.
#
# So tensorhooks calls that public switch, which keeps every rule of transformers (which layers,
# `every_n_layers`, the cache, models that override the switch), then puts its own function in
# the attribute of exactly the modules that carry the flag, as the switch does (the attribute
# the class docstring of `GradientCheckpointingLayer` names). The Trainer calls the switch again
# at the start of `train()` when `TrainingArguments(activation_checkpointing=True)`, putting
# torch's function back; `checkpoint_trainer`'s callback replaces it in `on_train_begin`, which
# the Trainer calls after that setup and before the first step.

_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(checkpoint).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
)
"""The keyword options of `tensorhooks.checkpoint` (``use_reentrant``, ``context_fn``, ...)."""

NO_OP = ("use_reentrant", False)
"""The one (option, value) that changes nothing: tensorhooks' checkpoint is non-reentrant."""


class LayerCheckpoint:
    """The checkpoint function a Hugging Face layer calls: `tensorhooks.checkpoint`.

    Non-reentrant (``use_reentrant=False``, so nothing warns), with the ``options`` given; with
    ``offload``, the region's inputs are kept in host memory by `tensorhooks.save_on_cpu`
    (transformers' ``offload=True`` does the same with torch's ``save_on_cpu``). Holds nothing
    but its options, so a copy of the model (``copy.deepcopy``) copies it.
    """

    __slots__ = ("offload", "options")

    def __init__(self, options: Mapping[str, Any], offload: bool) -> None:
        self.options = dict(options)
        self.offload = offload

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.offload:
            return checkpoint(function, *args, use_reentrant=False, **self.options, **kwargs)
        with save_on_cpu(pin_memory=torch.cuda.is_available()):
            return checkpoint(function, *args, use_reentrant=False, **self.options, **kwargs)

    def __repr__(self) -> str:
        return f"LayerCheckpoint(offload={self.offload}, options={self.options})"


def layer_checkpoint(options: Mapping[str, Any], offload: object, caller: str) -> LayerCheckpoint:
    """The function for the layers, its options checked now rather than at the first step.

    Raises:
        CheckpointArgumentValueError: an option `tensorhooks.checkpoint` does not take,
            ``use_reentrant`` other than False, or ``offload`` not a bool.
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise CheckpointArgumentValueError(
            f"{caller}: {unknown} are not options of tensorhooks.checkpoint; it takes "
            f"{sorted(_OPTIONS)}"
        )
    if options.get("use_reentrant", False) is not False:
        raise CheckpointArgumentValueError(
            f"{caller}: use_reentrant={options['use_reentrant']!r}: tensorhooks.checkpoint is "
            "non-reentrant only (torch.autograd.grad works with it); leave use_reentrant out "
            "or pass False"
        )
    if not isinstance(offload, bool):
        raise CheckpointArgumentValueError(
            f"{caller}: offload must be a bool, got {offload!r} of type {type(offload).__name__}"
        )
    kept = {name: value for name, value in options.items() if name != "use_reentrant"}
    return LayerCheckpoint(kept, offload)


def _flagged(model: nn.Module) -> Iterator[Any]:
    """The modules that carry transformers' ``gradient_checkpointing`` flag (duck-typed)."""
    return (module for module in model.modules() if hasattr(module, "gradient_checkpointing"))


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether transformers' checkpointing is on in some module of ``model``."""
    return any(module.gradient_checkpointing is True for module in _flagged(model))


def refuse_torch_wrappers(model: nn.Module, caller: str) -> None:
    """Refuse a model whose layers torch's ``checkpoint_wrapper`` checkpoints already.

    FSDP's ``activation_checkpointing`` option (accelerate's FSDP plugin, the Trainer's
    ``fsdp_config``) wraps each layer in torch's ``CheckpointWrapper``; checkpointing the layer
    again inside would recompute it twice.

    Raises:
        CheckpointArgumentValueError: if a module of ``model`` is such a wrapper.
    """
    for name, module in model.named_modules():
        if type(module).__name__ == "CheckpointWrapper":
            raise CheckpointArgumentValueError(
                f"{caller}: {name or 'the model'} is wrapped by torch's checkpoint_wrapper "
                "(FSDP's activation_checkpointing option, or apply_activation_checkpointing), "
                "so its layers would be checkpointed twice; turn that option off "
                "(activation_checkpointing=False in the FSDP plugin or fsdp_config)"
            )


def switch_on(model: nn.Module, every_n_layers: object, caller: str) -> None:
    """Turn transformers' checkpointing on (torch's function, replaced by `use_function`).

    Raises:
        CheckpointArgumentTypeError: if ``model`` is not a transformers model with
            ``activation_checkpointing_enable`` (transformers 5.24 or later).
        CheckpointArgumentValueError: if the model does not support checkpointing, or
            ``every_n_layers`` is not an int >= 1.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if not isinstance(model, nn.Module) or enable is None:
        raise CheckpointArgumentTypeError(
            f"{caller}: {type(model).__name__} is not a transformers model with "
            "activation_checkpointing_enable() (transformers >= 5.24); checkpoint other models' "
            "blocks with tensorhooks.checkpoint or tensorhooks.plan_activations"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise CheckpointArgumentValueError(
            f"{caller}: {type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is False); plan it with "
            "tensorhooks.plan_activations instead"
        )
    if (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise CheckpointArgumentValueError(
            f"{caller}: every_n_layers must be an int >= 1, got {every_n_layers!r}"
        )
    enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers)


def switch_off(model: nn.Module) -> None:
    """Turn transformers' checkpointing off (``activation_checkpointing_disable()``)."""
    hf_model: Any = model
    hf_model.activation_checkpointing_disable()


def use_function(model: nn.Module, function: LayerCheckpoint, caller: str) -> None:
    """Give every module transformers' switch set its function to ``function`` instead.

    Raises:
        CheckpointArgumentValueError: if no module of ``model`` has checkpointing on.
    """
    if not hf_checkpointing_on(model):
        raise CheckpointArgumentValueError(
            f"{caller}: no layer of {type(model).__name__} has checkpointing on after "
            "activation_checkpointing_enable(); its layers do not checkpoint through "
            "transformers' switch, so plan them with tensorhooks.plan_activations"
        )
    for module in _flagged(model):
        module._gradient_checkpointing_func = function
