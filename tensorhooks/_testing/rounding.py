"""How far rounding may move a correct run's gradients, measured on the computation itself.

See NOTE [Rounding, not wrong gradients].
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorhooks._core.torch_compat import TorchDispatchMode, op_schema

__all__ = ["RUNS", "SAFETY", "ULPS", "Perturbation", "differences", "perturbing", "tolerances"]

# NOTE [Rounding, not wrong gradients]
#
# A correct context may change the last bits of a gradient. Cloning a non-dense view (torch's
# cloning pair, allow_mutation_on_saved_tensors) makes it dense, so a sum over it, in a
# checkpoint's recomputation or in backward, adds the same numbers in another order; a lossy
# pair (bfloat16 copies) rounds every saved value. A wrong gradient (a stale value, a zero, a
# permuted copy) moves by the size of the values instead. What tells them apart is the size of
# a rounding error in *this* computation: it scales with the magnitude of what was summed (not
# of the result: a sum that cancels moves as much as its terms do) and with whatever later ops
# amplify it (``exp(exp(x))``); no fixed tolerance follows both.
#
# So the tolerance is measured. Sums and products computed in any order are backward stable:
# the result is the exact result of inputs each changed by a relative few units in the last
# place (ulps). The reference runs again, RUNS times, under `Perturbation`, a dispatch mode that
# hands every op (forward, recomputation and backward alike) its floating-point inputs with
# each element multiplied by ``1 + a * r``: ``r`` uniform in [-1, 1] from a generator seeded by
# the run, ``a`` ULPS ulps of the input's dtype (at most 1/64) or, when the check is given a
# ``precision``, that dtype's eps if larger. Inputs an op writes or aliases (``self`` of an
# in-place op, a view's base, ``out=``) are left alone, so the program's aliasing is unchanged.
# A result may then differ from the reference by SAFETY times the largest change those runs show
# in the same tensor (on top of the caller's rtol/atol). Where the gradient does not depend on
# rounding the runs show no change, and the comparison stays bitwise; the runs happen only when
# the first, bitwise comparison fails. A ``precision`` of bfloat16 accepts what computing every
# op with bfloat16's rounding could change, which covers a pair that keeps saved tensors in
# bfloat16 and scales with the values. A dispatch mode acts on the thread that entered it, so a
# program that runs backward on a worker thread runs it on the calling thread in a perturbed run
# (`perturbing` tells it): the same ops, perturbed alike.

ULPS = 64
SAFETY = 4.0
RUNS = 2
_MAX_AMPLITUDE = 2.0**-6
_perturbed_threads = threading.local()


def perturbing() -> bool:
    """Whether a `Perturbation` is active on this thread."""
    return bool(getattr(_perturbed_threads, "depth", 0))


class Perturbation(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Every op reads its floating-point inputs changed by a few ulps (see the NOTE)."""

    def __init__(self, seed: int, precision: torch.dtype | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.generator = torch.Generator().manual_seed(seed)
        self.floor = torch.finfo(precision).eps if precision is not None else 0.0

    def __enter__(self) -> Perturbation:
        _perturbed_threads.depth = getattr(_perturbed_threads, "depth", 0) + 1
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's __enter__ is untyped
        return self

    def __exit__(self, *exc: object) -> None:
        _perturbed_threads.depth -= 1
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's __exit__ is untyped

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        positional, named = list(args), dict(kwargs or {})
        for position, argument in enumerate(op_schema(func).arguments):
            if argument.alias_info is not None:
                continue
            if position < len(positional) and not argument.kwarg_only:
                positional[position] = self._perturbed(positional[position])
            elif argument.name in named:
                named[argument.name] = self._perturbed(named[argument.name])
        return func(*positional, **named)

    def _perturbed(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._perturbed(item) for item in value)
        return value

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if (
            not tensor.is_floating_point()
            or tensor.layout != torch.strided
            or tensor.is_meta
            or tensor.numel() == 0
        ):
            return tensor
        amplitude = max(min(ULPS * torch.finfo(tensor.dtype).eps, _MAX_AMPLITUDE), self.floor)
        noise = torch.rand(tensor.shape, generator=self.generator, dtype=torch.float64)
        factor = (1 + amplitude * (2 * noise - 1)).to(device=tensor.device, dtype=tensor.dtype)
        return tensor * factor


Tensors = Sequence[torch.Tensor | None]


def tolerances(reference: Tensors, runs: Sequence[Tensors | None]) -> list[float]:
    """Per result: SAFETY times the largest change the perturbed ``runs`` show from ``reference``.

    A run that failed (None) or gave results of another structure is left out.
    """
    found = [0.0] * len(reference)
    with torch.no_grad():
        for run in runs:
            if run is None or len(run) != len(reference):
                continue
            for index, (want, moved) in enumerate(zip(reference, run, strict=True)):
                if want is None or moved is None or want.shape != moved.shape:
                    continue
                finite = want.isfinite() & moved.isfinite()
                if bool(finite.any()):
                    change = float((moved - want).abs()[finite].max())
                    found[index] = max(found[index], SAFETY * change)
    return found


def differences(
    want: Tensors,
    have: Tensors,
    label: Callable[[int], str],
    *,
    rtol: float,
    atol: float,
    rounding: Sequence[float] | None = None,
) -> str | None:
    """None when ``have`` matches ``want`` within rtol/atol plus ``rounding``, else what differs."""
    if len(want) != len(have):
        return f"{len(have)} results instead of {len(want)}"
    for index, (expected, got) in enumerate(zip(want, have, strict=True)):
        if (expected is None) != (got is None):
            return f"{label(index)}: {got} instead of {expected}"
        if expected is None or got is None:
            continue
        allowed = rounding[index] if rounding is not None else 0.0
        try:
            torch.testing.assert_close(
                got, expected, rtol=rtol, atol=atol + allowed, equal_nan=True
            )
        except AssertionError as error:
            note = f" (rounding allowed up to {allowed:.3g})" if rounding is not None else ""
            return f"{label(index)}{note}: {error}"
    return None
