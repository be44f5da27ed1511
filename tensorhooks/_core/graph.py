"""The names of `torch.autograd.graph` that tensorhooks re-exports unchanged.

tensorhooks reimplements the five hook APIs and has nothing to add to the rest of
``torch.autograd.graph.__all__``, so ``import tensorhooks as graph`` gets torch's own objects
for those. The names every supported torch has are imported here by name, so type checkers see
them; names that only some releases have (``region_activation_memory_budget`` on 2.13,
``queue_callback`` and ``node_creation_hook`` later) are read from the installed torch at import
time by `torch_only_names`. `grad_node` answers, for every feature, which node fires a
tensor's hooks.
"""

from __future__ import annotations

import torch
import torch.autograd.graph as _torch_graph
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge, increment_version

__all__ = [
    "REIMPLEMENTED",
    "GradientEdge",
    "Node",
    "get_gradient_edge",
    "grad_node",
    "increment_version",
    "torch_only_names",
]

REIMPLEMENTED = frozenset(
    {
        "allow_mutation_on_saved_tensors",
        "disable_saved_tensors_hooks",
        "register_multi_grad_hook",
        "save_on_cpu",
        "saved_tensors_hooks",
    }
)
"""The names of ``torch.autograd.graph`` that tensorhooks implements itself."""

_STATIC = frozenset({"GradientEdge", "Node", "get_gradient_edge", "increment_version"})

# Public names of ``torch.autograd.graph`` that some releases define without listing them in its
# ``__all__``; re-exported where the installed torch has them. ``queue_callback`` became public
# in torch 2.15 (pytorch#193958, which lists it in ``__all__``); named here too, so that it is
# re-exported wherever torch has the attribute, whatever its ``__all__`` says. Before 2.15 only
# the engine's private method exists (`_core.torch_compat.queue_callback`), and tensorhooks has
# no ``queue_callback`` either, as torch's ``torch.autograd.graph`` has none.
_UNLISTED = ("node_creation_hook", "queue_callback")


def torch_only_names() -> dict[str, object]:
    """The installed torch's other ``torch.autograd.graph.__all__`` names, with their objects.

    Those neither reimplemented by tensorhooks nor imported by name above: what this release of
    torch has beyond the oldest supported one, and the public names it may leave out of its
    ``__all__`` (``node_creation_hook``, ``queue_callback``).
    """
    names = set(getattr(_torch_graph, "__all__", ())) - REIMPLEMENTED - _STATIC
    names.update(name for name in _UNLISTED if hasattr(_torch_graph, name))
    return {name: getattr(_torch_graph, name) for name in sorted(names)}


def grad_node(tensor: torch.Tensor) -> Node:
    """The node whose execution fires ``tensor``'s hooks: its grad_fn, or a leaf's accumulator.

    Holding a leaf's accumulator keeps it alive: autograd only caches it weakly, and a new one
    would be a different node from the one the engine runs.
    """
    grad_fn = tensor.grad_fn
    if grad_fn is not None:
        return grad_fn
    if not torch.is_grad_enabled():  # entering enable_grad costs more than the view: only here
        with torch.enable_grad():
            return grad_node(tensor)
    accumulator: Node = tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr, assignment]  # a leaf requiring grad has one
    return accumulator
