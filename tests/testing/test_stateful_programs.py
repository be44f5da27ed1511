"""State regions keep in Python objects, and backward on a worker thread: drawn, and judged.

The kinds of STATEFUL_KINDS draw what training code keeps outside a region's arguments (masks,
caches, swapped data, lazy modules, rebound attributes, swapped layers, a parent module,
BatchNorm), and "thread" runs backward on a worker thread. The checker must require plain
autograd's results on them and accept an error only where the program changed what a region
read between its forward pass and backward: checkpoints broken in each known way fail it, and
torch's checkpoint passes where it is right. tensorhooks.checkpoint's property tests on these
kinds are strict xfails where it raises false alarms or gives wrong results today.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, find, given, settings

from tensorhooks._testing.stateful import STATEFUL_KINDS
from tensorhooks.testing import GradientMismatchError, Program, check_checkpoint, programs

from .broken_checkpoints import thread_bound, torch_checkpoint, watching
from .kinds import ONE_THREAD, STATEFUL_SIGNS

# Stops at the first failing program (no shrinking): enough to show a class is reached.
_SEARCH = settings(
    max_examples=300,
    derandomize=True,
    phases=[Phase.generate],
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
_FIND = settings(_SEARCH, max_examples=2000)

# How the forms of each kind show in a program's source.
FORMS = {
    "kept": [
        r"kept\.mask = ",
        r"kept\.masks\['",
        r"kept\.register_buffer\('mask_",
        r"\n        if '\w+' not in cache:",
        r"kept\.scale = torch\.full",
        r"cache\['scale_\w+'\] = torch\.full",
        r"return h\d+, \(\w",
        r"return \{'out': h\d+, 'masks': \[",
    ],
    "data": [r"\.data = full\d+\.clone\(\)", r"\.data = torch\.renorm\(", r"\.data = flat\["],
    "rebound": [
        r"cell\d+\.h = h\d+\.detach\(\)",
        r"cell\d+\.m = 0\.9 \* cell\d+\.m \+ 0\.1 \* \w+\n",
        r"cell\d+\.m = 0\.9 \* cell\d+\.m \+ 0\.1 \* .*\.detach\(\)",
        r"cell\d+\.step = cell\d+\.step \+ 1",
        r"cell\d+\.t = cell\d+\.t \+ 1",
        r"\n        (cell\d+)\.(\w+) = (?s:.*)\n        \1\.\2 = ",  # a cell used twice
    ],
    "swapped": [
        r"pair\d+\['a'\], pair\d+\['b'\] = ",
        r"pair\d+\[0\], pair\d+\[1\] = ",
        r"pair\d+\[0\]\.weight, pair\d+\[1\]\.weight = ",
    ],
    "parent": [rf"model\.blocks\[{block}\]\(" for block in range(3)],
    "norm": [r"(norm\d+)\((?s:.*)= \1\("],  # one layer run twice
    "lazy": [r"torch\.nn\.LazyLinear"],
}


def _forms() -> list[tuple[str, str]]:
    return [(kind, form) for kind, forms in FORMS.items() for form in forms]


@pytest.mark.parametrize(("kind", "form"), _forms())
def test_every_form_of_each_stateful_kind_is_drawn(kind: str, form: str) -> None:
    """Each form of each kind (each holder, swap, counter, nested output) shows in a program."""
    assert set(FORMS) == set(STATEFUL_KINDS)
    found = find(
        programs(checkpoint=[kind]),
        lambda program: re.search(form, program.source) is not None,
        settings=_FIND,
    )
    assert re.search(STATEFUL_SIGNS[kind], found.source)


def test_backward_on_a_worker_thread_is_drawn_both_ways() -> None:
    """The "thread" variant runs backward() or autograd.grad on a thread, raising its error."""
    for call in (r"outcome\.append\(loss\.backward\(\)\)", r"outcome\.append\(torch\.autograd"):
        found = find(
            programs(backwards=["thread"]),
            lambda program, call=call: re.search(call, program.source) is not None,
            settings=_FIND,
        )
        assert "raise outcome[0]" in found.source


def _check(
    kinds: tuple[str, ...],
    checkpoint: Callable[..., Any] | None,
    *,
    backwards: tuple[str, ...] = ONE_THREAD,
    max_examples: int = 300,
) -> None:
    """check_checkpoint with ``checkpoint`` over programs of ``kinds``."""

    @settings(_SEARCH, max_examples=max_examples)
    @given(programs(checkpoint=kinds, backwards=backwards))
    def check(program: Program) -> None:
        assume(check_checkpoint(program, checkpoint))

    check()


# Each kind, a checkpoint broken on it, and what the checker says.
BROKEN: dict[str, tuple[Callable[..., Any], str]] = {
    "kept": (watching("start"), "raised where plain autograd does not"),
    "data": (watching("start"), "raised where plain autograd does not"),
    "lazy": (watching("start"), "raised where plain autograd does not"),
    "parent": (torch_checkpoint, "changed a gradient"),
    "rebound": (torch_checkpoint, "changed a gradient"),
    "swapped": (torch_checkpoint, "changed a gradient"),
    "norm": (torch_checkpoint, "changed a gradient"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_the_checker_catches_a_broken_checkpoint(kind: str) -> None:
    """A checkpoint wrong on the kind (a false alarm, a wrong gradient or state) fails the check.

    The watching checkpoint raises where what a region reaches changed at all (its own mask
    rebuilt, its own ``.data`` swap, a lazy module initialised); torch's recomputes from state
    rebound since and from a swapped layer, and writes BatchNorm's running statistics (its own
    or a block's reached through the parent) a second time.
    """
    checkpoint, says = BROKEN[kind]
    with pytest.raises(GradientMismatchError, match=says) as failure:
        _check((kind,), checkpoint)
    assert re.search(STATEFUL_SIGNS[kind], str(failure.value))


def test_the_checker_catches_a_checkpoint_bound_to_its_thread() -> None:
    """A recomputation that goes wrong on a worker thread fails the check on "thread" programs."""
    with pytest.raises(GradientMismatchError, match="changed a gradient") as failure:
        _check((), thread_bound, backwards=("thread",))
    assert "threading.Thread(target=on_thread)" in str(failure.value)


@pytest.mark.parametrize("kind", ["data", "kept", "lazy", "thread"])
def test_torch_checkpoint_passes_where_it_is_right(kind: str) -> None:
    """The control: torch's checkpoint rebuilds masks, redoes idempotent swaps, runs on threads.

    No error is expected of it there, and the checker requires none.
    """
    if kind == "thread":
        _check((), torch_checkpoint, backwards=("thread",), max_examples=40)
    else:
        _check((kind,), torch_checkpoint, max_examples=40)


# --- tensorhooks.checkpoint on each kind --------------------------------------------------------


def _tensorhooks_params() -> list[Any]:
    return [pytest.param(kind) for kind in (*sorted(STATEFUL_KINDS), "thread")]


# Where a kind's class needs a program of some shape, the draws that give it more often: two
# regions and backward over all of them (a later block's statistics), arguments aliasing (a
# leaf passed twice, recomputed on a worker thread).
_DRAWN: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    "parent": (("parent",), ("backward", "twice"), 300),
    "thread": (("aliasing",), ("thread",), 200),
}


@pytest.mark.parametrize("kind", _tensorhooks_params())
def test_tensorhooks_checkpoint_on_each_kind(kind: str) -> None:
    """tensorhooks.checkpoint gives plain autograd's results, or an error the program explains."""
    kinds, backwards, max_examples = _DRAWN.get(kind, ((kind,), ONE_THREAD, 150))
    _check(kinds, None, backwards=backwards, max_examples=max_examples)


# --- what explains an error: fixed programs ----------------------------------------------------

_HEAD = """
import torch
from tensorhooks import checkpoint


def make_leaves():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()]


def program(leaves):
    leaf0, = leaves
    torch.manual_seed(0)
"""
# A region runs block 1 of the model; a later region runs block 0, whose BatchNorm writes its
# statistics: nothing the first region read changed.
_LATER_BLOCK = """
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([
        torch.nn.Sequential(
            torch.nn.Linear(4, 4, dtype=torch.float64),
            torch.nn.BatchNorm1d(4, dtype=torch.float64),
        ),
        torch.nn.Linear(4, 4, dtype=torch.float64),
    ])
    def region0(x):
        return model.blocks[1](x).sin()
    def region1(x):
        return model.blocks[0](x).tanh()
    v0 = checkpoint(region0, leaf0 * 1, use_reentrant=False)
    v1 = checkpoint(region1, leaf0 * 2, use_reentrant=False)
    (v0.sum() + v1.pow(2).sum()).backward()
    return [leaf0.grad, *(b.clone() for b in model.buffers())]
"""
# A region reads a cell's hidden state and rebinds it; a later region uses the cell again.
_CELL_AGAIN = """
    cell = torch.nn.Module()
    cell.h = torch.zeros(4, 4, dtype=torch.float64)
    def region0(x):
        h0 = torch.tanh(x + cell.h)
        cell.h = h0.detach()
        return h0
    v0 = checkpoint(region0, leaf0 * 1, use_reentrant=False)
    v1 = checkpoint(region0, leaf0 * 2, use_reentrant=False)
    (v0.pow(2).sum() + v1.pow(2).sum()).backward()
    return [leaf0.grad, cell.h]
"""
# A region calls one layer of a pair; the program swaps the pair before backward.
_SWAPPED = """
    pair = [torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Linear(4, 4, dtype=torch.float64)]
    def region0(x):
        return pair[0](x).sin()
    v0 = checkpoint(region0, leaf0 * 1, use_reentrant=False)
    pair[0], pair[1] = pair[1], pair[0]
    v0.pow(2).sum().backward()
    return [leaf0.grad]
"""
# A region gathers a leaf's data (the same values each call), then reads it; a later region
# gathers it again.
_GATHERED = """
    full = leaf0.detach().clone()
    def region0(x):
        leaf0.data = full.clone()
        return (x @ leaf0).sin()
    v0 = checkpoint(region0, leaf0 * 1, use_reentrant=False)
    v1 = checkpoint(region0, leaf0 * 2, use_reentrant=False)
    (v0.sum() + v1.sum()).backward()
    return [leaf0.grad]
"""


def _program(body: str) -> Program:
    return Program(_HEAD + body.removeprefix("\n"), n_leaves=1)


@pytest.mark.parametrize(
    "body", [_LATER_BLOCK, _GATHERED], ids=["later_block_of_the_parent", "gathered_again"]
)
def test_an_error_over_what_the_region_did_not_read_is_a_false_alarm(body: str) -> None:
    """A later block's statistics, or data swapped to equal values, explain no error."""
    with pytest.raises(GradientMismatchError, match="raised where plain autograd does not"):
        check_checkpoint(_program(body), watching("end"))


@pytest.mark.parametrize("body", [_CELL_AGAIN, _SWAPPED], ids=["cell_used_again", "pair_swapped"])
def test_an_error_over_what_changed_after_the_call_is_accepted(body: str) -> None:
    """State the region read, rebound or swapped after its call, explains the error."""
    assert check_checkpoint(_program(body), watching("end"))
    with pytest.raises(GradientMismatchError, match="changed a gradient"):
        check_checkpoint(_program(body), torch_checkpoint)  # a silently wrong gradient
