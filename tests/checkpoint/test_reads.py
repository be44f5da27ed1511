"""What a region reads outside its arguments, however reached: replaced, rebound or stepped."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tensorhooks
from tests.checkpoint.common import th_ckpt as checkpoint
from tests.checkpoint.common import torch_ckpt

Block = Callable[[torch.Tensor], torch.Tensor]
# A way to build a region and a change made between its forward pass and backward.
Case = Callable[[], tuple[Block, Callable[[], None]]]


class Shifted(nn.Module):
    """Linear, then a buffer added (read, never saved), then sin (saves its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).double()
        self.register_buffer("shift", torch.linspace(-1, 1, 4, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (self.linear(h) + self.shift).sin()


def _module() -> Shifted:
    torch.manual_seed(0)
    return Shifted()


def _new(like: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(like) + 2


def _replace_weight() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def change() -> None:
        module.linear.weight = nn.Parameter(_new(module.linear.weight))

    return module, change


def _replace_bias() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def change() -> None:
        module.linear.bias = nn.Parameter(_new(module.linear.bias))

    return module, change


def _replace_in_parameters_dict() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def change() -> None:
        module.linear._parameters["weight"] = nn.Parameter(_new(module.linear.weight))

    return module, change


def _reassign_buffer() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def change() -> None:
        module.shift = _new(module.shift)

    return module, change


def _set_data() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def change() -> None:
        module.linear.weight.data = _new(module.linear.weight)

    return module, change


def _dict_in_closure() -> tuple[Block, Callable[[], None]]:
    modules = {"block": _module()}

    def change() -> None:
        with torch.no_grad():
            modules["block"].linear.bias.add_(1)

    return lambda h: modules["block"](h), change  # noqa: PLW0108 (the item read at call time)


def _dict_buffer_in_closure() -> tuple[Block, Callable[[], None]]:
    modules = {"block": _module()}

    def change() -> None:
        modules["block"].shift.add_(1)

    return lambda h: modules["block"](h), change  # noqa: PLW0108 (the item read at call time)


def _module_swapped_in_dict() -> tuple[Block, Callable[[], None]]:
    modules = {"block": _module()}

    def change() -> None:
        torch.manual_seed(5)
        modules["block"] = Shifted()

    return lambda h: modules["block"](h), change  # noqa: PLW0108 (the item read at call time)


def _closure_rebound() -> tuple[Block, Callable[[], None]]:
    torch.manual_seed(0)
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        return (h @ weight + 1).sin()

    def change() -> None:
        nonlocal weight
        weight = _new(weight).requires_grad_()

    return block, change


def _constant_rebound() -> tuple[Block, Callable[[], None]]:
    shift = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def block(h: torch.Tensor) -> torch.Tensor:
        return (h + shift).sin()

    def change() -> None:
        nonlocal shift
        shift = _new(shift)

    return block, change


_GLOBAL = {"module": _module()}


def _through_a_global() -> tuple[Block, Callable[[], None]]:
    _GLOBAL["module"] = _module()

    def change() -> None:
        with torch.no_grad():
            _GLOBAL["module"].linear.bias.mul_(3)

    return _global_block, change


def _global_block(h: torch.Tensor) -> torch.Tensor:
    return _GLOBAL["module"](h)


def _global_replaced() -> tuple[Block, Callable[[], None]]:
    _GLOBAL["module"] = _module()

    def change() -> None:
        _GLOBAL["module"].linear.bias = nn.Parameter(_new(_GLOBAL["module"].linear.bias))

    return _global_block, change


def _object_attribute() -> tuple[Block, Callable[[], None]]:
    holder = types.SimpleNamespace(inner=types.SimpleNamespace(module=_module()))

    def change() -> None:
        with torch.no_grad():
            holder.inner.module.linear.bias.sub_(1)

    return lambda h: holder.inner.module(h), change  # noqa: PLW0108 (read at call time)


class _Shared:
    """Holds a module as a class attribute, shared by every instance."""

    module = _module()


def _class_attribute() -> tuple[Block, Callable[[], None]]:
    _Shared.module = _module()
    holder = _Shared()

    def change() -> None:
        _Shared.module.linear.bias = nn.Parameter(_new(_Shared.module.linear.bias))

    return lambda h: holder.module(h), change  # noqa: PLW0108 (read at call time)


def _deep_closure() -> tuple[Block, Callable[[], None]]:
    module = _module()

    def outer() -> Block:
        def middle() -> Block:
            def inner(h: torch.Tensor) -> torch.Tensor:
                return module(h)

            return inner

        return middle()

    block = outer()

    def change() -> None:
        with torch.no_grad():
            module.linear.bias.add_(1)

    return lambda h: block(h), change  # noqa: PLW0108 (read at call time)


def _parameter_dict() -> tuple[Block, Callable[[], None]]:
    torch.manual_seed(0)
    weights = nn.ParameterDict({"w": nn.Parameter(torch.randn(4, 4, dtype=torch.float64))})
    shift = nn.Parameter(torch.randn(4, dtype=torch.float64))
    store = {"weights": weights, "shift": shift}

    def block(h: torch.Tensor) -> torch.Tensor:
        return (h @ store["weights"]["w"] + store["shift"]).sin()

    def change() -> None:
        store["shift"] = nn.Parameter(_new(shift))

    return block, change


def _optimizer_step(**options: bool) -> Case:
    def case() -> tuple[Block, Callable[[], None]]:
        module = _module()
        optimizer = torch.optim.Adam(module.parameters(), lr=0.5, **options)

        def change() -> None:
            for parameter in module.parameters():
                parameter.grad = torch.ones_like(parameter)
            optimizer.step()

        return module, change

    return case


CASES: dict[str, Case] = {
    "module.weight = Parameter": _replace_weight,
    "module.bias = Parameter": _replace_bias,
    "_parameters['weight'] = ...": _replace_in_parameters_dict,
    "buffer reassigned": _reassign_buffer,
    "param.data = ...": _set_data,
    "dict in closure, bias stepped": _dict_in_closure,
    "dict in closure, buffer written": _dict_buffer_in_closure,
    "module swapped in a dict": _module_swapped_in_dict,
    "closure rebound": _closure_rebound,
    "constant rebound": _constant_rebound,
    "global, bias stepped": _through_a_global,
    "global, bias replaced": _global_replaced,
    "plain object's attribute": _object_attribute,
    "class attribute": _class_attribute,
    "closure of a closure of a closure": _deep_closure,
    "ParameterDict, item rebound": _parameter_dict,
    "Adam for-loop": _optimizer_step(foreach=False),
    "Adam foreach": _optimizer_step(foreach=True),
    "Adam fused": _optimizer_step(fused=True),
}


def _input() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True)


def _gradient(run: Callable[..., torch.Tensor] | None, case: Case) -> torch.Tensor:
    block, change = case()
    x = _input()
    out = block(x) if run is None else run(block, x)
    change()
    (gradient,) = torch.autograd.grad(out.sum(), [x])
    return gradient


# Rebindings of what the region found bound by name (a buffer, a closure variable): recomputation
# runs with the binding the call saw, so the gradient is plain autograd's.
RESTORED = frozenset(
    {
        "buffer reassigned",
        "closure rebound",
        "constant rebound",
        "module swapped in a dict",
        "ParameterDict, item rebound",
    }
)


@pytest.mark.parametrize("name", sorted(set(CASES) - RESTORED))
def test_a_change_between_forward_and_backward_raises(name: str) -> None:
    """Each way of changing what the region read raises before a recomputed value is used."""
    with pytest.raises(tensorhooks.SavedTensorModifiedError):
        _gradient(checkpoint, CASES[name])


@pytest.mark.parametrize("name", sorted(RESTORED))
def test_a_rebinding_is_undone_for_recomputation(name: str) -> None:
    """A name rebound between the forward pass and backward: recomputation reads the old value."""
    expected = _gradient(None, CASES[name])
    torch.testing.assert_close(_gradient(checkpoint, CASES[name]), expected, rtol=0, atol=0)


_TORCH_SILENT = sorted(name for name in CASES if not name.startswith("Adam "))


@pytest.mark.parametrize("name", _TORCH_SILENT)
def test_torch_checkpoint_is_silently_wrong(name: str) -> None:
    """The non-reentrant checkpoint gives another gradient than plain autograd, silently."""
    assert not torch.allclose(_gradient(torch_ckpt, CASES[name]), _gradient(None, CASES[name]))


@pytest.mark.parametrize("options", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_every_optimizer_step_moves_versions(options: dict[str, bool]) -> None:
    """After any Adam implementation's step, a saved weight raises in plain autograd too."""
    checkpoint(torch.sin, _input())  # the hook is installed with a checkpoint call
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _gradient(None, _optimizer_step(**options))


def test_unchanged_reads_match_plain_autograd() -> None:
    """Without a change, every way of reaching the module gives plain autograd's gradients."""
    for name, case in CASES.items():
        block, _ = case()
        x = _input()
        (got,) = torch.autograd.grad(checkpoint(block, x).sum(), [x])
        (expected,) = torch.autograd.grad(block(x).sum(), [x])
        assert torch.equal(got, expected), name


def test_a_leaf_made_inside_the_region_is_not_a_replacement() -> None:
    """A tensor requiring grad created by the function each call is the recomputation's own."""

    def block(h: torch.Tensor) -> torch.Tensor:
        scale = torch.full((4,), 2.0, dtype=torch.float64, requires_grad=True)
        return (h * scale).sin() * scale

    x = _input()
    (got,) = torch.autograd.grad(checkpoint(block, x).sum(), [x])
    (expected,) = torch.autograd.grad(block(x).sum(), [x])
    assert torch.equal(got, expected)


def test_replacement_under_allow_mutation_raises_naming_it() -> None:
    """Inside allow_mutation_on_saved_tensors a replaced weight raises too, naming the change."""
    module, change = _replace_weight()
    x = _input()
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = checkpoint(module, x)
        change()
        with pytest.raises(
            tensorhooks.SavedTensorModifiedError,
            match=r"recomputation read a different tensor than the forward pass.*Parameter",
        ):
            torch.autograd.grad(out.sum(), [x])


def test_set_data_names_the_tensor() -> None:
    """A weight whose data was swapped raises naming it and what to do."""
    with pytest.raises(
        tensorhooks.SavedTensorModifiedError, match=r"the data of .*weight.*was replaced"
    ):
        _gradient(checkpoint, _set_data)


class GrowingCache(nn.Module):
    """Binds a new buffer in its own forward pass when the input outgrows it (a rope cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(2, dtype=torch.float64), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.table.shape[0] < h.shape[-1]:
            self.table = torch.linspace(0.5, 1.5, h.shape[-1], dtype=torch.float64)
        return (h + self.table).sin()


def test_a_buffer_bound_by_the_forward_pass_itself_is_not_a_replacement() -> None:
    """A module that binds a new buffer while it runs is recomputed with it, as plain autograd."""
    cache = GrowingCache()
    x = _input()
    (got,) = torch.autograd.grad(checkpoint(cache, x).sum(), [x])
    (expected,) = torch.autograd.grad(GrowingCache()(x).sum(), [x])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("form", ["checkpoint(module)", "checkpoint_module", "partial"])
def test_what_a_module_forward_reaches_is_watched(form: str) -> None:
    """A module's forward's closure tensor: rebound, read as at the call; written, refused."""
    from tensorhooks.checkpointing import checkpoint_module

    scale = [torch.randn(4, 4, dtype=torch.float64)]

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, scale[0])

    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if form == "checkpoint_module":
            checkpoint_module(block)
            return block(x)
        if form == "partial":
            return checkpoint(functools.partial(lambda m, h: m(h), block), x)
        return checkpoint(block, x)

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(Block()(x).sum(), [x])
    out = run(Block(), x)
    scale[0] = torch.zeros(4, 4, dtype=torch.float64)  # rebound before backward
    (got,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    out = run(Block(), x)
    scale[0].add_(1)  # written before backward
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match=r"scale\[0\]"):
        out.sum().backward()
