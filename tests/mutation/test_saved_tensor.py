"""The handle autograd stores for a saved tensor: memory, and writes the context did not see.

Writes the context cannot intercept raise, never go silent. See
NOTE [Detecting writes the context did not see] in tensorhooks/_mutation/saved_tensor.py.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import pytest
import torch

import tensorhooks
from tests.mutation.programs import leaf_4x6

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def test_dropped_graph_frees_everything() -> None:
    """A graph dropped without backward frees saved outputs and clones (no cycles)."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        b = torch.tanh(a * 1)  # saves its output
        out = b.exp().sum()  # saves its output too
        b.mul_(2.0)
        watched = weakref.ref(b)
        del b, out
        assert watched() is None
        assert ctx.num_saved() == 0


# --- writes the context did not see ---------------------------------------------------------------


MODIFIED = "modified by an inplace operation"


def _sparse() -> torch.Tensor:
    indices = torch.tensor([[0, 1], [1, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that sparse invariant checks are off
        return torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (2, 2)).coalesce()


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s._values().mul_(10),
        lambda s: s.values().mul_(10),
        lambda s: s._indices().fill_(0),
    ],
    ids=["_values", "values", "_indices"],
)
def test_write_to_sparse_component_raises(write: object) -> None:
    """A write through a sparse tensor's components raises, as plain autograd does."""
    s = _sparse()
    d = torch.randn(2, 2, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = (s @ d).sum()
        write(s)  # type: ignore[operator]
        with pytest.raises(tensorhooks.SavedTensorModifiedError, match=MODIFIED):
            out.backward()
    # Plain autograd raises too: the context keeps that answer rather than a wrong gradient.
    s = _sparse()
    out = (s @ d).sum()
    write(s)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=MODIFIED):
        out.backward()


def test_csr_values_write_raises() -> None:
    """A write to a CSR tensor's values after it was saved raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta warning for sparse CSR
        s = _sparse().to_sparse_csr()
    d = torch.randn(2, 2, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta warning for sparse CSR
        out = (s @ d).sum()
        s.values().mul_(10)
        with pytest.raises(tensorhooks.SavedTensorModifiedError, match=MODIFIED):
            out.backward()


def test_write_on_thread_without_context_raises() -> None:
    """A write made on a thread with no open context makes backward raise, not go wrong."""
    x = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        a = x * 1
        out = (a * a).sum()
        worker = threading.Thread(target=a.detach().mul_, args=(10,))
        worker.start()
        worker.join()
        with pytest.raises(tensorhooks.SavedTensorModifiedError, match="did not see"):
            out.backward()


def test_write_on_thread_without_context_raises_for_guarded_pair() -> None:
    """The same holds for tensors saved by user hooks pushed inside the context."""
    x = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        a = x * 1
        with tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = (a * a).sum()
        worker = threading.Thread(target=a.detach().mul_, args=(10,))
        worker.start()
        worker.join()
        with pytest.raises(tensorhooks.SavedTensorModifiedError, match="did not see"):
            out.backward()


def test_seen_write_to_disjoint_slice_still_allowed() -> None:
    """A seen write beside a saved slice bumps the shared counter but does not raise."""
    x = torch.randn(6, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors() as context:
        base = x * 1
        head = base[:3]
        out = (head * head).sum()
        base[3:].mul_(10)  # same storage and version counter, other bytes
        base[4:].add_(1)  # a second write: the recorded version moves again
        torch._foreach_mul_([base[3:4], base[5:]], 2.0)  # two writes on the storage in one op
        out.backward()
        assert context.num_cloned() == 0
    assert torch.equal(x.grad, torch.cat([2 * x.detach()[:3], torch.zeros(3)]))  # type: ignore[arg-type]


def test_seen_overlapping_write_still_clones() -> None:
    """A seen write that reaches the saved tensor clones it, and backward uses the clone."""
    x = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        a = x * 1
        out = (a * a).sum()
        a.mul_(10)
        a.add_(1)
        out.backward()
    assert torch.allclose(x.grad, 2 * x.detach())  # type: ignore[arg-type]
