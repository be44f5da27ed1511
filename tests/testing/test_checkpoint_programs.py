"""Random checkpointed programs: tensorhooks.checkpoint gives plain autograd's results; torch's not.

The program generator draws the kinds of region that silently wrong recomputations came from
(outside tensors read through views, state written in the region, aliasing arguments written in
place, selective policies). torch's own checkpoint fails on two of them, which shows that the
generator reaches them; tensorhooks.checkpoint passes on all. Reproducers of the classes it once
found in tensorhooks itself are kept below.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st

import tensorhooks
from tensorhooks._testing.programs import REGION_KINDS
from tensorhooks._testing.reached import CONTAINERS, OPTIMIZERS
from tensorhooks.testing import (
    GradientMismatchError,
    Program,
    check_checkpoint,
    programs,
)

from .kinds import ONE_THREAD, STATEFUL_SIGNS
from .program_source import regions, root

CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]] | None] = {
    "none": None,
    "allow_mutation": tensorhooks.allow_mutation_on_saved_tensors,
}
KINDS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "aliasing_inplace": ("aliasing", "inplace"),
    "outside": ("outside",),
    "state": ("state",),
    "policy_inplace": ("inplace", "policy"),
    "reached": ("reached", "outside"),
    "all": REGION_KINDS,
}


def _examples(divisor: int) -> int:
    """A share of the active profile's examples: fourteen combinations are checked."""
    return max(10, (settings().max_examples or 100) // divisor)


@pytest.mark.parametrize("context", sorted(CONTEXTS))
@pytest.mark.parametrize("kinds", sorted(KINDS))
@settings(max_examples=_examples(2))
@given(data=st.data())
def test_tensorhooks_checkpoint_matches_plain_autograd(
    kinds: str, context: str, data: st.DataObject
) -> None:
    """Every kind of region gives plain autograd's results, its in-place error, or save-time's."""
    program = data.draw(programs(checkpoint=KINDS[kinds]), label="program")
    assume(check_checkpoint(program, context_factory=CONTEXTS[context]))


def _torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


def _ours(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return tensorhooks.checkpoint(function, *args, use_reentrant=False, **kwargs)


# The first failing program is enough to show the class is reached: no shrinking.
_SEARCH = settings(
    max_examples=600,
    derandomize=True,
    phases=[Phase.generate],
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _check_torch(kinds: tuple[str, ...], max_examples: int) -> None:
    """Check torch's checkpoint on programs whose regions are of ``kinds`` (no policies)."""

    @settings(_SEARCH, max_examples=max_examples)
    @given(programs(checkpoint=kinds, backwards=ONE_THREAD))
    def check(program: Program) -> None:
        assume(check_checkpoint(program, _torch_checkpoint))

    check()


def test_torch_checkpoint_passes_on_plain_regions() -> None:
    """The control: on regions of plain ops, torch's checkpoint gives plain autograd's results."""
    _check_torch((), max_examples=200)


@pytest.mark.parametrize(
    ("kinds", "found"),
    [
        pytest.param(("outside",), r"def region", id="outside_tensor_written_after_the_call"),
        pytest.param(("state",), r"with torch.no_grad\(\):", id="state_written_in_the_region"),
        pytest.param(("reached",), r"box\d|\.data = |optim", id="state_replaced_or_stepped"),
    ],
)
def test_the_generator_finds_torch_checkpoints_wrong_results(
    kinds: tuple[str, ...], found: str
) -> None:
    """Hypothesis finds torch's checkpoint wrong on outside tensors and on state it writes."""
    with pytest.raises(GradientMismatchError, match=r"the checkpointed run") as failure:
        _check_torch(kinds, max_examples=600)
    assert re.search("neither the save-time one|changed a gradient", str(failure.value))
    assert re.search(found, str(failure.value))


def _aliasing(program: Program) -> bool:
    """A region's arguments alias one value."""
    return any(
        len({root(argument) for argument in arguments}) < len(arguments)
        for _, arguments in regions(program)
    )


def _writes_in(program: Program, names: Callable[[ast.FunctionDef], set[str]]) -> bool:
    """A region writes in place (``x.add_(...)``, ``x[...] = c``) a value ``names`` gives."""
    for function, _ in regions(program):
        for node in ast.walk(function):
            call = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(call, ast.Attribute)
                and call.attr.endswith("_")
                and root(call.value) in names(function)
            ):
                return True
    return False


def _parameters_and_locals(function: ast.FunctionDef) -> set[str]:
    assigned = {
        target.id
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return assigned | {argument.arg for argument in function.args.args}


def _reads_outside(program: Program) -> bool:
    """A region reads a value of the program that is not among its arguments."""
    for function, _ in regions(program):
        own = _parameters_and_locals(function)
        read = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        if read & {"leaf0", "leaf1", "leaf2"} - own or any(
            name.startswith("v") for name in read - own
        ):
            return True
    return False


def _sign(pattern: str) -> Callable[[Program], bool]:
    return lambda program: re.search(pattern, program.source) is not None


SIGNS: dict[str, Callable[[Program], bool]] = {
    "aliasing": _aliasing,
    "inplace": lambda program: _writes_in(program, _parameters_and_locals),
    "module": lambda program: (
        re.search(r"checkpoint_module\(module\d\)", program.source) is not None
    ),
    "outside": _reads_outside,
    "policy": lambda program: "context_fn=contexts" in program.source,
    "reached": lambda program: re.search(r"def region(?s:.)*box\d", program.source) is not None,
    "state": lambda program: _writes_in(program, lambda function: {"const", "count"}),
    **{kind: _sign(pattern) for kind, pattern in STATEFUL_SIGNS.items()},
}


@pytest.mark.parametrize("kind", REGION_KINDS)
def test_every_kind_of_region_is_drawn(kind: str) -> None:
    """Each kind of REGION_KINDS shows in the drawn programs' source."""
    example = find(
        programs(checkpoint=[kind]),
        SIGNS[kind],
        settings=settings(
            database=None, max_examples=2000, derandomize=True, phases=[Phase.generate]
        ),
    )
    assert SIGNS[kind](example)


# --- classes the generator found in tensorhooks.checkpoint: each asserts plain autograd's result --


def _leaf(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()


def test_closure_reads_a_tensor_that_is_also_an_argument() -> None:
    """A tensor both an argument and read from the closure, written later: save-time gradient."""

    def gradient(checkpoint: Callable[..., Any]) -> torch.Tensor:
        weight = _leaf()
        with tensorhooks.allow_mutation_on_saved_tensors():
            out = checkpoint(lambda x: torch.nn.functional.linear(x, weight), weight)
            with torch.no_grad():
                weight.add_(-1.5)
            (grad,) = torch.autograd.grad(out.sum(), [weight])
        return grad

    plain = gradient(lambda function, *args: function(*args))
    torch.testing.assert_close(gradient(_ours), plain, rtol=0, atol=0)


def test_state_written_in_a_region_and_backward_twice() -> None:
    """A counter incremented in a region and saved after it survives a second backward."""

    def gradient(checkpoint: Callable[..., Any]) -> torch.Tensor:
        x = _leaf()
        count = torch.zeros((), dtype=torch.float64)

        def region(h: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                count.add_(1)
            return h.sin()

        loss = checkpoint(region, x).sum() + (count * x).sum()  # the product saves count
        loss.backward(retain_graph=True)
        loss.backward()
        assert x.grad is not None
        return x.grad

    plain = gradient(lambda function, *args: function(*args))
    torch.testing.assert_close(gradient(_ours), plain, rtol=0, atol=0)


def _window_gradient(checkpoint: Callable[..., Any], offset: int) -> torch.Tensor:
    """The gradient of a region writing ``x.as_strided((2,), (1,), offset)``, x = leaf[1]."""
    leaf = _leaf()

    def region(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.as_strided((2,), (1,), offset).add_(-1.5)
        return x * x

    with tensorhooks.allow_mutation_on_saved_tensors():
        (grad,) = torch.autograd.grad(checkpoint(region, leaf[1]).sum(), [leaf])
    return grad


def test_as_strided_window_of_an_argument_under_allow_mutation() -> None:
    """A write through an as_strided window of an argument reaches the same elements again."""
    plain = _window_gradient(lambda function, *args: function(*args), 4)  # leaf[1, :2]: x's
    torch.testing.assert_close(_window_gradient(_ours, 4), plain, rtol=0, atol=0)


def test_as_strided_window_past_the_argument_written_by_the_region_raises() -> None:
    """A window past the argument (leaf[0, :2], x = leaf[1]) written by the region: it raises.

    The forward pass changed those elements, so their values at the call are gone.
    """
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match="reaches past its arguments"):
        _window_gradient(_ours, 0)


def test_state_that_is_a_view_saved_then_written() -> None:
    """A view buffer saved, written in the region and after it: its value at the call is used."""

    def gradient(checkpoint: Callable[..., Any]) -> torch.Tensor:
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        buffer = torch.full((2, 2), 2.0, dtype=torch.float64).view(4)

        def region(h: torch.Tensor) -> torch.Tensor:
            out = h * buffer  # saves the buffer
            with torch.no_grad():
                buffer.add_(1)
            return out

        with tensorhooks.allow_mutation_on_saved_tensors():
            out = checkpoint(region, x)
            with torch.no_grad():
                buffer.add_(1)
            (grad,) = torch.autograd.grad(out.sum(), [x])
        return grad

    plain = gradient(lambda function, *args: function(*args))
    torch.testing.assert_close(gradient(_ours), plain, rtol=0, atol=0)


def test_as_strided_window_past_the_argument_of_a_changed_storage_raises() -> None:
    """A window reaching past the argument, whose storage changed after the call: it raises."""
    leaf = _leaf()

    def region(x: torch.Tensor) -> torch.Tensor:
        return x * x.as_strided((2, 2), (2, 1), 1).sum()  # element 4 is leaf[1, 0], not x's

    with tensorhooks.allow_mutation_on_saved_tensors():
        out = tensorhooks.checkpoint(region, leaf[0::2], use_reentrant=False)
        with torch.no_grad():
            leaf.add_(-1.5)
        with pytest.raises(
            tensorhooks.SavedTensorModifiedError, match="reaches past its arguments"
        ):
            torch.autograd.grad(out.sum(), [leaf])


# How each holder and each change shows in a program's source.
_HOLDER_SIGNS = {
    "list": r"box\d+ = \[",
    "tuple": r"box\d+ = \(v|box\d+ = \(leaf|box\d+ = \(const",
    "dict": r"box\d+ = \{'t'",
    "object": r"types\.SimpleNamespace\(t=",
    "global": r"globals\(\)\['box",
    "module": r"box\d+ = torch\.nn\.Module\(\)",
    "moduledict": r"torch\.nn\.ModuleDict",
}
_CHANGE_SIGNS = {
    **{name: re.escape(options) for name, options in OPTIMIZERS.items()},
    "data": r"\.data = ",
    "rebound in a holder": r"\n    box\d+(\[|\.t =| = \()|globals\(\)\['box\d+'\] = \(",
}


@pytest.mark.parametrize("sign", [*sorted(_HOLDER_SIGNS), *sorted(_CHANGE_SIGNS)])
def test_every_holder_and_change_is_drawn(sign: str) -> None:
    """Each holder of CONTAINERS, each optimizer of OPTIMIZERS and each rebinding is drawn."""
    assert set(_HOLDER_SIGNS) == set(CONTAINERS)
    pattern = {**_HOLDER_SIGNS, **_CHANGE_SIGNS}[sign]
    example = find(
        programs(checkpoint=["reached"]),
        lambda program: re.search(pattern, program.source) is not None,
        settings=settings(
            database=None, max_examples=3000, derandomize=True, phases=[Phase.generate]
        ),
    )
    assert re.search(pattern, example.source)


# A weight reached through an object, stepped after the call: plain autograd saved nothing of it
# (the input needs no grad), checkpoint raises because recomputation would read another weight.
_STEPPED_AFTER_THE_CALL = """
import torch
import types
from tensorhooks import checkpoint


def make_leaves():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()]


def program(leaves):
    leaf0, = leaves
    const = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)
    box0 = types.SimpleNamespace(t=leaf0)
    def region0(x):
        return torch.nn.functional.linear(x, box0.t)
    loss = checkpoint(region0, const, use_reentrant=False).sum()
    leaf0.grad = torch.ones_like(leaf0)
    torch.optim.Adam([leaf0], lr=0.25, foreach=False).step()
    leaf0.grad = None
    loss.backward()
    return [leaf0.grad]
"""


def test_a_reached_tensor_stepped_after_the_call_explains_the_in_place_error() -> None:
    """Checkpoint's error for a weight stepped since the call is accepted, not a false alarm."""
    program = Program(source=_STEPPED_AFTER_THE_CALL, n_leaves=1)
    with pytest.raises(tensorhooks.SavedTensorModifiedError):
        program.run(program.make_leaves(), checkpoint=tensorhooks.checkpoint)
    assert check_checkpoint(program)
