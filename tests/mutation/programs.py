"""Programs that save a tensor and then change it in place, and how to run them for a gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.graph as torch_graph

from tests.strategies import Square

Program = Callable[[torch.Tensor], torch.Tensor]


def grad_under(context: Callable[[], Any] | None, program: Program, leaf: torch.Tensor) -> Any:
    """The gradient of ``program(leaf)`` with forward and backward run inside ``context()``."""
    leaf = leaf.detach().clone().requires_grad_()
    with context() if context is not None else contextlib.nullcontext():
        program(leaf).backward()
    return leaf.grad


def leaf_4x6() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


# Programs that save a tensor, then change it in place, then return the loss. ``reference``
# computes the same function with the saving op reading a clone, so nothing it saved is changed.


def save_then_write_same_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b.sin_()
    return out


def save_then_write_out_same_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    with torch.no_grad():
        torch.mul(torch.ones_like(b), 3.0, out=b)
    return out


def save_then_foreach(a: torch.Tensor) -> torch.Tensor:
    b, c = a * 1, a * 2
    out = (b**2).sum() + c.sin().sum()
    torch._foreach_mul_([b, c], 2.0)
    return out


def saved_many_times(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b * b).sum() + (b**3).sum() + b.sin().sum()
    b.mul_(5.0)
    return out


def saved_at_several_versions(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b.mul_(2.0)
    out = out + (b**3).sum()
    b.add_(1.0)
    out = out + b.sin().sum()
    b.zero_()
    return out


def saved_output_written(a: torch.Tensor) -> torch.Tensor:
    b = torch.tanh(a)  # saves its output
    out = b.sum()
    b.mul_(3.0)
    return out


def transposed_view_at_same_address(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b.t() ** 2).sum()
    b.mul_(2.0)
    return out


def custom_function_saved(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = Square.apply(b).sum()
    b.add_(3.0)
    return out  # type: ignore[no-any-return]


TORCH_IS_RIGHT: dict[str, Program] = {
    "same_tensor": save_then_write_same_tensor,
    "out_same_tensor": save_then_write_out_same_tensor,
    "foreach": save_then_foreach,
    "saved_many_times": saved_many_times,
    "saved_at_several_versions": saved_at_several_versions,
    "saved_output": saved_output_written,
    "transposed_view_same_address": transposed_view_at_same_address,
    "custom_function": custom_function_saved,
}


def write_through_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b[1:].mul_(2.0)
    return out


def save_view_write_base(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    b.mul_(2.0)
    return out


def strided_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[:, 1::2] ** 2).sum()
    b.t()[3].zero_()  # column 3, inside the saved strided view
    return out


def overlapping_slices(a: torch.Tensor) -> torch.Tensor:
    flat = (a * 1).view(-1)
    out = (flat[0:10] ** 2).sum()
    flat[8:16].mul_(-1.0)
    return out


def out_into_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    with torch.no_grad():
        torch.add(torch.zeros(2, 6, dtype=a.dtype), 1.0, out=b[2:])
    return out


def write_after_unrelated_write(a: torch.Tensor) -> torch.Tensor:
    # The first write bumps the version counter the saved view shares; torch then keys the
    # second write by the new version and misses the saved entry.
    b = a * 1
    out = (b[1:] ** 2).sum()
    b[0].zero_()
    b[1:].mul_(2.0)
    return out


def dtype_view_write(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    with torch.no_grad():
        b.view(torch.int64)[2].bitwise_xor_(1 << 51)
    return out


TORCH_IS_WRONG: dict[str, Program] = {
    "write_through_view": write_through_view,
    "save_view_write_base": save_view_write_base,
    "strided_view": strided_view,
    "overlapping_slices": overlapping_slices,
    "out_into_view": out_into_view,
    "write_after_unrelated_write": write_after_unrelated_write,
    "dtype_view": dtype_view_write,
}


def reference(program: Program) -> Program:
    """``program`` with every saved tensor cloned at save time, so no write can reach it."""

    def run(a: torch.Tensor) -> torch.Tensor:
        with torch_graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
            return program(a)

    return run
