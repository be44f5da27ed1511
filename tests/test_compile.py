"""tensorhooks' contexts under torch.compile: no more graph breaks than torch's, clear errors.

See NOTE [Contexts under torch.compile] in tensorhooks/_compile.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.autograd import graph as torch_graph

import tensorhooks
from tensorhooks import _compile

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

Make = Callable[[], Any]

# (name, torch's context, tensorhooks') made inside the compiled function.
CONTEXTS: list[tuple[str, Make, Make]] = [
    (
        "saved_tensors_hooks",
        lambda: torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        lambda: tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t),
    ),
    ("save_on_cpu", torch_graph.save_on_cpu, tensorhooks.save_on_cpu),
    (
        "disable_saved_tensors_hooks",
        lambda: torch_graph.disable_saved_tensors_hooks("no"),
        lambda: tensorhooks.disable_saved_tensors_hooks("no"),
    ),
    (
        "allow_mutation_on_saved_tensors",
        torch_graph.allow_mutation_on_saved_tensors,
        tensorhooks.allow_mutation_on_saved_tensors,
    ),
]


def program(make: Make) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        with make():
            y = (y * y).exp()
            y = torch.relu(y) * 2
        return y.cos()

    return run


def graph_breaks(make: Make) -> int:
    """Graph breaks of `program` compiled (eager backend); checks its result against eager's."""
    dynamo.reset()
    counters.clear()
    x = torch.randn(4)
    compiled = torch.compile(program(make), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(x)
    assert torch.allclose(out, program(torch.enable_grad)(x))
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize(("name", "theirs", "ours"), CONTEXTS, ids=[c[0] for c in CONTEXTS])
def test_no_more_graph_breaks_than_torch(name: str, theirs: Make, ours: Make) -> None:
    """Entered inside a compiled function, each context breaks the graph at most as torch's."""
    assert graph_breaks(ours) <= graph_breaks(theirs), name


@pytest.mark.parametrize(
    ("name", "ours"),
    [(c[0], c[2]) for c in CONTEXTS if c[0] != "disable_saved_tensors_hooks"],
    ids=[c[0] for c in CONTEXTS if c[0] != "disable_saved_tensors_hooks"],
)
def test_fullgraph_error_names_the_context(name: str, ours: Make) -> None:
    """Under fullgraph=True the error names the context and says to enter it outside."""
    dynamo.reset()
    compiled = torch.compile(program(ours), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=rf"tensorhooks\.{name} cannot be entered inside"):
        compiled(torch.randn(4, requires_grad=True))


def test_disable_traces_in_one_graph_like_torch() -> None:
    """disable_saved_tensors_hooks compiles under fullgraph=True, as torch's does."""
    dynamo.reset()
    make = CONTEXTS[2][2]
    compiled = torch.compile(program(make), backend="eager", fullgraph=True)
    x = torch.randn(4)
    assert torch.allclose(compiled(x), program(make)(x))


@pytest.mark.parametrize(("name", "ours"), [(c[0], c[2]) for c in CONTEXTS[:2]])
def test_compiled_model_inside_the_context_matches_eager(name: str, ours: Make) -> None:
    """A compiled model called inside the context gives eager's gradients."""
    dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    with ours():
        compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(got, model.parameters(), strict=True))


def test_compile_skipped_under_allow_mutation_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled function called inside allow_mutation_on_saved_tensors warns: it runs eagerly."""
    if not hasattr(torch.utils._python_dispatch, "any_torch_dispatch_mode_on_stack"):
        pytest.skip("this torch does not ask the mode before skipping; no warning there")
    monkeypatch.setattr(_compile, "_warned", set())
    dynamo.reset()
    compiled = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    x = torch.randn(3, requires_grad=True)
    with (
        pytest.warns(UserWarning, match="compiles nothing inside tensorhooks.allow_mutation"),
        tensorhooks.allow_mutation_on_saved_tensors(),
    ):
        compiled(x).sum().backward()
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())


def test_entering_contexts_outside_compile_does_not_warn() -> None:
    """Plain eager use of every context raises no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _, _, ours in CONTEXTS:
            with ours():
                (torch.ones(2, requires_grad=True) * 2).sum().backward()
