"""Hugging Face layers under a plan: their KV cache, and their own gradient checkpointing.

See NOTE [Caches of Hugging Face layers] below.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = [
    "CACHE_ARGUMENTS",
    "cache_arguments",
    "hf_checkpointing_message",
    "hf_checkpointing_on",
    "is_hf_layer",
    "positional_names",
    "writes_cache",
]

# NOTE [Caches of Hugging Face layers]
#
# A Hugging Face decoder layer (a ``GradientCheckpointingLayer``) appends its keys and values to
# the KV cache it is handed; recomputing it in backward would append them again (a size error,
# or checkpoint's "ran during recomputation but not in the forward pass"). A plan does with the
# cache what Hugging Face's own gradient checkpointing does (``GradientCheckpointingLayer`` in
# transformers/modeling_layers.py), which checkpoints a layer only in training mode:
#
# - In training mode (``module.training``) a checkpointed layer runs without a cache:
#   ``use_cache=False``, and unless the layer only reads the cache
#   (``_can_checkpoint_with_cache``), ``cache=None`` and ``layer_past=None``. Causal LMs keep
#   ``use_cache=True`` in training; the checkpointed layers leave their entries out of the cache,
#   as with Hugging Face's.
# - In eval mode the cache is kept: Hugging Face does not checkpoint there, and a chunk that
#   continues from the cache (a second chunk of a long sequence, with gradients on) must see
#   every layer's entries. A layer the plan checkpoints runs as it is when it is handed a cache
#   it writes (it holds all its activations then: the plan warns once), and checkpointed with its
#   arguments unchanged otherwise (no cache, or one it only reads).
# - A layer the plan keeps always runs as it is, and fills the cache.

CACHE_ARGUMENTS = ("cache", "layer_past", "past_key_value", "past_key_values")
"""The names Hugging Face layers take a KV cache by (``cache`` since transformers 5)."""


def is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``GradientCheckpointingLayer``."""
    return hasattr(type(module), "_can_checkpoint_with_cache")


def _reads_only(module: nn.Module) -> bool:
    """Whether a Hugging Face layer only reads its cache (and may be checkpointed with it)."""
    return getattr(type(module), "_can_checkpoint_with_cache", False) is True


def positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters, in order (none if it has no signature)."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(parameter.name for parameter in parameters if parameter.kind in kinds)


@functools.cache
def _class_positions(kind: type[Any]) -> tuple[str, ...]:
    """The positional parameters of ``kind.forward`` after ``self``."""
    return positional_names(kind.forward)[1:]


def writes_cache(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    positions: Sequence[str] | None = None,
) -> bool:
    """Whether a Hugging Face layer is handed a cache it writes (by name, or by position).

    ``positions`` are the names of the forward's positional parameters; default: the class's.
    """
    if not is_hf_layer(module) or _reads_only(module):
        return False
    if positions is None:
        positions = _class_positions(type(module))  # type: ignore[arg-type]  # hashable class
    named = dict(zip(positions, args, strict=False))
    return any(
        kwargs.get(name) is not None or named.get(name) is not None for name in CACHE_ARGUMENTS
    )


def cache_arguments(
    module: nn.Module, positions: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments a checkpointed block runs with, or None where it must run as it is.

    See NOTE [Caches of Hugging Face layers]: a Hugging Face layer in training mode has its
    cache turned off; in eval mode, handed a cache it writes, it is not checkpointed (None);
    every other call keeps its arguments. A cache passed by position (GPT-2's blocks take it
    second) is found by its parameter's name in ``positions``, the names of the forward's
    positional parameters.
    """
    if not is_hf_layer(module):
        return args, kwargs
    if not module.training:
        return None if writes_cache(module, args, kwargs, positions) else (args, kwargs)
    names = ("use_cache",) if _reads_only(module) else ("use_cache", *CACHE_ARGUMENTS)
    off = {name: False if name == "use_cache" else None for name in names}
    changed = {name: _off(off, name, value) for name, value in kwargs.items()}
    values = [_off(off, name, value) for name, value in zip(positions, args, strict=False)]
    return (*values, *args[len(values) :]), changed


def _off(off: dict[str, Any], name: str, value: Any) -> Any:
    """``value``, or what turns the cache off if ``name`` is a cache argument (None stays)."""
    return off[name] if name in off and value is not None else value


def hf_checkpointing_message(caller: str) -> str:
    """What to say when Hugging Face's gradient checkpointing is on under a plan."""
    return (
        f"{caller}: the model's own gradient checkpointing is on "
        "(model.activation_checkpointing_enable(), or its deprecated alias "
        "gradient_checkpointing_enable()), so its layers would be checkpointed twice and the "
        "plan's figures would not hold; call model.activation_checkpointing_disable() (the plan "
        "checkpoints the layers itself)"
    )


def hf_checkpointing_on(modules: Sequence[nn.Module]) -> bool:
    """Whether Hugging Face's gradient checkpointing is on in ``modules`` or inside them."""
    return any(
        getattr(inner, "gradient_checkpointing", False) is True
        for module in modules
        for inner in module.modules()
    )
