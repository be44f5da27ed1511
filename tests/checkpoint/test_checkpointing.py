"""tensorhooks.checkpointing: every name of torch.utils.checkpoint; one import line moves code."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import tensorhooks
from tensorhooks import checkpointing
from tests.checkpoint.common import assert_same, block_of, input_tensor, weights

# The names tensorhooks implements; every other one is torch's own object.
OURS = {
    "checkpoint": tensorhooks.checkpoint,
    "checkpoint_module": None,  # tensorhooks' only: the counterpart of torch's composable form
    "checkpoint_sequential": None,
    "create_selective_checkpoint_contexts": tensorhooks.create_selective_checkpoint_contexts,
    "noop_context_fn": None,
}


def test_names_are_torchs_on_every_release() -> None:
    """__all__ holds every name of the installed torch's torch.utils.checkpoint.__all__."""
    extra = {name for name in OURS if not hasattr(torch_checkpoint, name)}
    assert set(checkpointing.__all__) == set(torch_checkpoint.__all__) | extra
    assert len(checkpointing.__all__) == len(set(checkpointing.__all__))


def test_star_import_gives_all() -> None:
    """``from tensorhooks.checkpointing import *`` binds every name of __all__."""
    namespace: dict[str, object] = {}
    exec("from tensorhooks.checkpointing import *", namespace)  # what a user's star import binds
    assert sorted(name for name in namespace if name != "__builtins__") == sorted(
        checkpointing.__all__
    )


@pytest.mark.parametrize("name", sorted(set(torch_checkpoint.__all__) - set(OURS)))
def test_the_rest_are_torchs_own_objects(name: str) -> None:
    """Names tensorhooks does not implement are torch's objects, not copies."""
    assert getattr(checkpointing, name) is getattr(torch_checkpoint, name)


def test_implemented_names_are_tensorhooks() -> None:
    """The names tensorhooks implements are its own objects, not torch's."""
    for name, value in OURS.items():
        assert getattr(checkpointing, name).__module__.startswith("tensorhooks."), name
        if value is not None:
            assert getattr(checkpointing, name) is value


@pytest.fixture
def restores_debug_logger() -> Iterator[None]:
    """Puts torch's debug logger back as it was: torch leaves it configured after debug=True.

    (Its capture sets the "LoggingTensor" logger to not propagate and adds a filter each time;
    pytest then attaches its capture handlers to that logger, which cannot format its records.)
    """
    logger = logging.getLogger("LoggingTensor")
    state = (logger.propagate, logger.level, list(logger.filters), list(logger.handlers))
    yield
    logger.propagate, level, logger.filters, logger.handlers = state
    logger.setLevel(level)


@pytest.mark.usefixtures("restores_debug_logger")
def test_noop_context_fn_behaves_as_torchs() -> None:
    """Two contexts that do nothing, as torch's; debug=True accepts it as the default."""
    for contexts in (checkpointing.noop_context_fn(), torch_checkpoint.noop_context_fn()):
        assert [type(context) for context in contexts] == [contextlib.nullcontext] * 2
    x = input_tensor()
    out = checkpointing.checkpoint(
        torch.sin, x, use_reentrant=False, debug=True, context_fn=checkpointing.noop_context_fn
    )
    out.sum().backward()


def _torch_script(cp: types.ModuleType) -> list[torch.Tensor]:
    """A script written for torch.utils.checkpoint, run on the module ``cp``."""
    w1, w2 = weights()
    x = input_tensor()
    block = block_of(w1, w2)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        assert isinstance(ctx, cp.SelectiveCheckpointContext)
        assert op not in cp.SAC_IGNORED_OPS
        if op == torch.ops.aten.mm.default:
            return cp.CheckpointPolicy.MUST_SAVE
        return cp.CheckpointPolicy.PREFER_RECOMPUTE

    selective = functools.partial(cp.create_selective_checkpoint_contexts, policy)
    h = cp.checkpoint(block, x, use_reentrant=False, context_fn=selective)
    with cp.set_checkpoint_early_stop(False):
        h = cp.checkpoint(block, h, use_reentrant=False, determinism_check="none")
    layers = torch.nn.Sequential(*(torch.nn.Linear(6, 6, dtype=torch.float64) for _ in range(4)))
    torch.manual_seed(0)
    layers.apply(lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None)
    h = cp.checkpoint_sequential(layers, 2, h, use_reentrant=False)
    return list(torch.autograd.grad(h.square().sum(), [x, w1, w2, *layers.parameters()]))


def test_a_torch_script_runs_unchanged_with_one_import_changed() -> None:
    """The same code on torch.utils.checkpoint and on tensorhooks.checkpointing: same grads."""
    assert_same(_torch_script(checkpointing), _torch_script(torch_checkpoint))
    assert tensorhooks.live_graph_tasks() == 0


def _tail_runs(early_stop_context: Callable[[], Any], early_stop: bool = True) -> int:
    tail: list[int] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        out = h.sin()  # the only tensor saved
        tail.append(1)
        return out

    with early_stop_context():
        out = checkpointing.checkpoint(block, input_tensor(), use_reentrant=False)
    out.sum().backward()
    return len(tail) - 1


def test_set_checkpoint_early_stop_is_honoured() -> None:
    """set_checkpoint_early_stop(False) around the call: recomputation runs to the end."""
    assert _tail_runs(contextlib.nullcontext) == 0
    assert _tail_runs(lambda: checkpointing.set_checkpoint_early_stop(False)) == 1


@pytest.mark.usefixtures("restores_debug_logger")
def test_set_checkpoint_debug_enabled_is_honoured() -> None:
    """set_checkpoint_debug_enabled(True) adds torch's op log to a CheckpointError."""
    flip = {"on": False}
    on = flip.get  # a reader: recomputation reads the closure's own bindings as at the call

    def block(h: torch.Tensor) -> torch.Tensor:
        return h.exp() if on("on") else h.sin().cos()

    messages = []
    debug_on = functools.partial(checkpointing.set_checkpoint_debug_enabled, True)
    for context in (contextlib.nullcontext, debug_on):
        flip["on"] = False
        with context():
            out = checkpointing.checkpoint(block, input_tensor(), use_reentrant=False)
        flip["on"] = True
        with pytest.raises(checkpointing.CheckpointError) as caught:
            out.sum().backward()
        messages.append(str(caught.value))
    assert "original forward" not in messages[0]
    assert "original forward" in messages[1]


@pytest.mark.skipif(
    not hasattr(torch_checkpoint, "GraphExecGroup"), reason="torch has no GraphExecGroup"
)
def test_graph_exec_group_recomputes_per_backward_with_the_same_gradients() -> None:
    """Under GraphExecGroup, torch recomputes once for two backward calls; tensorhooks per call.

    Gradients are the same: only the saving of a second recomputation is not taken.
    """
    w1, w2 = weights()
    results = {}
    for name, run in (("torch", torch_checkpoint.checkpoint), ("ours", checkpointing.checkpoint)):
        runs: list[int] = []

        def block(h: torch.Tensor, runs: list[int] = runs) -> tuple[torch.Tensor, torch.Tensor]:
            runs.append(1)
            return (h @ w1).sin(), (h @ w2).cos()

        x = input_tensor()
        first, second = run(block, x, use_reentrant=False)
        with checkpointing.GraphExecGroup():
            (g1,) = torch.autograd.grad(first.sum(), [w1])
            (g2,) = torch.autograd.grad(second.sum(), [w2])
        results[name] = (len(runs) - 1, [g1, g2])
    assert results["torch"][0] == 1
    assert results["ours"][0] == 2
    assert_same(results["ours"][1], results["torch"][1])


def test_use_reentrant_left_out_neither_warns_nor_breaks_a_compiled_graph() -> None:
    """Under torch.compile the warning is not issued: it would break the graph."""
    w, _ = weights()

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(lambda a: (a @ w).sin(), x).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = input_tensor()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = torch.autograd.grad(compiled(x), [x])
    (expected,) = torch.autograd.grad(step_plain(x, w), [x])
    torch.testing.assert_close(got, expected)


def step_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin().sum()
