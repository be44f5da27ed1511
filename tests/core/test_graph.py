from __future__ import annotations

import pytest
import torch
import torch.autograd.graph as torch_graph

import tensorhooks
from tensorhooks._core.graph import REIMPLEMENTED, grad_node


def test_every_torch_graph_name_resolves() -> None:
    """Every name of the installed torch's torch.autograd.graph.__all__ is on tensorhooks."""
    missing = [name for name in torch_graph.__all__ if not hasattr(tensorhooks, name)]
    assert missing == []


def test_names_tensorhooks_adds_nothing_to_are_torch_objects() -> None:
    """Names tensorhooks does not reimplement are torch's own objects, not copies."""
    for name in set(torch_graph.__all__) - REIMPLEMENTED:
        assert getattr(tensorhooks, name) is getattr(torch_graph, name), name


def test_reimplemented_names_are_tensorhooks_own() -> None:
    """The five hook APIs are tensorhooks' implementations, each also in __all__."""
    for name in REIMPLEMENTED:
        assert getattr(tensorhooks, name) is not getattr(torch_graph, name), name
        assert name in tensorhooks.__all__


def test_all_stays_sorted_and_importable() -> None:
    """__all__ stays sorted with the re-exports in, and every name in it imports."""
    assert tensorhooks.__all__ == sorted(tensorhooks.__all__)
    namespace: dict[str, object] = {}
    exec("from tensorhooks import *", namespace)  # the star-import a user would write
    assert set(tensorhooks.__all__) <= set(namespace)


def test_reexports_work_on_tensorhooks_tensors() -> None:
    """The re-exported helpers work on graphs built under tensorhooks' hooks."""
    x = torch.ones(2, requires_grad=True)
    with tensorhooks.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = (x * x).sum()
    edge = tensorhooks.get_gradient_edge(y)
    assert isinstance(edge, tensorhooks.GradientEdge)
    assert isinstance(edge.node, tensorhooks.Node)
    (grad,) = torch.autograd.grad(y, x)
    assert torch.equal(grad, 2 * x.detach())


def test_unlisted_public_names_are_reexported(monkeypatch: pytest.MonkeyPatch) -> None:
    """node_creation_hook, public but outside torch's __all__, is re-exported where it exists."""
    from tensorhooks._core.graph import torch_only_names

    assert ("node_creation_hook" in torch_only_names()) == hasattr(
        torch_graph, "node_creation_hook"
    )
    marker = object()
    monkeypatch.setattr(torch_graph, "node_creation_hook", marker, raising=False)
    assert torch_only_names()["node_creation_hook"] is marker


def test_queue_callback_is_torchs_where_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """queue_callback (public from torch 2.15) is torch's object where torch has it, else absent."""
    from tensorhooks._core.graph import torch_only_names

    if hasattr(torch_graph, "queue_callback"):
        assert tensorhooks.queue_callback is torch_graph.queue_callback
        events: list[str] = []
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda grad: tensorhooks.queue_callback(lambda: events.append("end")))
        x.register_hook(lambda grad: events.append("leaf"))
        y.sum().backward()
        assert events == ["leaf", "end"]  # the callback ran once, after every node of backward
    else:
        assert not hasattr(tensorhooks, "queue_callback")
    # Re-exported whether or not the release lists it in __all__.
    marker = object()
    monkeypatch.setattr(torch_graph, "queue_callback", marker, raising=False)
    monkeypatch.setattr(
        torch_graph, "__all__", [n for n in torch_graph.__all__ if n != "queue_callback"]
    )
    assert torch_only_names()["queue_callback"] is marker


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_grad_node_is_the_node_backward_runs(grad_enabled: bool) -> None:
    """A leaf's accumulator (grad mode on or off), a non-leaf's grad_fn: the graph's own nodes."""
    leaf = torch.ones(2, requires_grad=True)
    out = leaf * 2
    with torch.set_grad_enabled(grad_enabled):
        leaf_node, out_node = grad_node(leaf), grad_node(out)
        assert torch.is_grad_enabled() is grad_enabled  # grad mode is left as it was
    assert leaf_node is out.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    assert leaf_node is torch_graph.get_gradient_edge(leaf).node
    assert out_node is out.grad_fn
