"""save_on_cpu's options: pin_memory=True where nothing can be pinned is said once."""

from __future__ import annotations

import warnings

import pytest
import torch

import tensorhooks as th
from tensorhooks._activation_offload import session
from tensorhooks._activation_offload.session import NothingPinnedWarning


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the warning without CUDA")
def test_pin_memory_without_cuda_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save_on_cpu(pin_memory=True) without CUDA warns, naming the fix; later ones not."""
    monkeypatch.setattr(session, "_nothing_pinned_said", False)
    x = torch.ones(3, requires_grad=True)
    with (
        pytest.warns(NothingPinnedWarning, match=r"no cuda device is available here") as seen,
        th.save_on_cpu(pin_memory=True, min_offload_bytes=0),
    ):
        (x * x).sum().backward()
    assert len(seen) == 1
    assert seen[0].filename == __file__  # points at the caller's line
    assert "pin_memory=torch.cuda.is_available()" in str(seen[0].message)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * x.detach())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=1):
            (x * x).sum().backward()


def test_pin_memory_false_and_tensorhooks_own_contexts_say_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pin_memory=False never warns; a context tensorhooks makes for itself does not either."""
    monkeypatch.setattr(session, "_nothing_pinned_said", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        th.save_on_cpu(pin_memory=False)
        policy = th.create_selective_checkpoint_contexts(
            lambda ctx, op, *args, **kwargs: th.CheckpointPolicy.MUST_CPU_OFFLOAD
        )
        x = torch.ones(4, requires_grad=True)
        th.checkpoint(
            lambda t: t.sin().sin(), x, context_fn=lambda: policy, use_reentrant=False
        ).sum().backward()
    assert not session._nothing_pinned_said or torch.cuda.is_available()
