"""What the measuring parts share: peak memory, timing that respects the deadline, gradients.

Every function takes the device the part runs on: ``"cuda"`` on the GPU, ``"cpu"`` in a dry
run, where device memory is not measured (None) and time is taken by ``Timer`` instead of CUDA
events. The timing is the one harness of ``benchmarks/harness.py`` (see NOTE [How tensorhooks
times things] there), called one round at a time so that a part near its deadline stops after
the round it is in rather than losing them all.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from harness import Timings, interleaved

from .record import Target, seconds_left

MiB = float(1 << 20)
GiB = float(1 << 30)
GB = 1e9

T = TypeVar("T")


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def allocated(device: str) -> int | None:
    """Bytes the caching allocator has handed out now (None on the CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def peak_above(step: Callable[[], object], device: str) -> tuple[int | None, int | None]:
    """Run ``step`` once; return its peak device memory above what was allocated before it.

    Returns:
        ``(peak above the memory before the step, memory before it)`` in bytes; ``(None,
        None)`` on the CPU.
    """
    if device != "cuda":
        step()
        return None, None
    torch.cuda.synchronize()
    before = int(torch.cuda.memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()) - before, before


def timed_rounds(
    variants: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    inner: int,
    device: str,
    reserve_s: float = 5.0,
) -> Timings:
    """Seconds per call of each variant, ``rounds`` interleaved rounds of ``inner`` calls.

    The order of the variants rotates from round to round. At least one round runs; another
    starts only while the deadline leaves room for it (as long as the longest round so far)
    plus ``reserve_s``.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    longest = 0.0
    for index in range(rounds if names else 0):
        if index and seconds_left() < longest + reserve_s:
            print(f"timed_rounds: stopped after {index} of {rounds} rounds (deadline)")
            break
        start = time.monotonic()
        shift = index % len(names)
        order = names[shift:] + names[:shift]
        timings = interleaved(
            {name: variants[name] for name in order},
            rounds=1,
            inner=inner,
            cuda_events=device == "cuda",
        )
        for name in names:
            samples[name] += timings.samples[name]
        longest = max(longest, time.monotonic() - start)
    return Timings(samples)


def attempt(label: str, errors: dict[str, str], fn: Callable[[], T]) -> T | None:
    """Call ``fn``; on an exception, record it (`record_failure`) and return None.

    One variant that fails (a missing package, an API that moved, a bug) must not cost the
    others their measurements; the part reports what failed beside what ran.
    """
    try:
        return fn()
    except Exception as error:  # a part reports every failure rather than stopping on it
        record_failure(label, errors, error)
        return None


def record_failure(label: str, errors: dict[str, str], error: Exception) -> None:
    """Print ``error``'s traceback to the log and keep its first line under ``label``."""
    traceback.print_exception(error)
    message = str(error).strip().splitlines()
    errors[label] = f"{type(error).__name__}: {message[0][:200] if message else ''}"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_difference(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor]) -> float:
    """The largest absolute elementwise difference between two sequences of tensors."""
    largest = 0.0
    for a, b in zip(got, want, strict=True):
        largest = max(largest, float((a.float() - b.to(a.device).float()).abs().max()))
    return largest


def bitwise_equal(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor]) -> bool:
    """Whether two sequences of tensors are equal bit for bit (shapes, dtypes and values)."""
    return all(
        a.dtype == b.dtype and torch.equal(a, b.to(a.device))
        for a, b in zip(got, want, strict=True)
    )


def gradient_verdict(bitwise: bool, difference: float, noise: float) -> str:
    """``equal``, ``within noise`` or ``DIFFERENT``, against the reference run against itself.

    ``noise`` is the largest difference between two runs of the reference (non-deterministic
    kernels such as flash attention's backward make it nonzero); a difference up to 4x that is
    read as noise.

    Example:
        >>> gradient_verdict(False, 1e-3, 5e-4), gradient_verdict(False, 1e-2, 0.0)
        ('within noise', 'DIFFERENT')
    """
    if bitwise:
        return "equal"
    return "within noise" if difference <= 4 * noise else "DIFFERENT"


def gradient_row(
    name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], noise: float
) -> tuple[list[str], str]:
    """One row of a gradient table, and its verdict (`gradient_verdict`)."""
    bitwise = bitwise_equal(got, want)
    difference = max_difference(got, want)
    verdict = gradient_verdict(bitwise, difference, noise)
    row = [name, "yes" if bitwise else "no", f"{difference:.3g}", f"{noise:.3g}", verdict]
    return row, verdict


def gradient_target(part: str, name: str, verdict: str | None, why_missing: str = "") -> Target:
    """The target "gradients equal to the reference's": met when equal or within noise."""
    if verdict is None:
        return Target(part, name, "-", GRADIENTS_BOUND, None, why_missing or "not measured")
    return Target(part, name, verdict, GRADIENTS_BOUND, verdict != "DIFFERENT")


GRADIENTS_BOUND = "equal, or within 4x the reference's own run-to-run difference"


GRADIENT_COLUMNS = (
    "setting",
    "bit for bit",
    "max abs difference",
    "reference vs itself",
    "verdict",
)


def init_single_process_group(device: str, scratch: Path) -> str:
    """A default process group of one process (NCCL on CUDA, gloo on the CPU); its backend."""
    import torch.distributed as dist  # noqa: PLC0415  # only the distributed parts need it

    backend = "nccl" if device == "cuda" else "gloo"
    if dist.is_initialized():
        return backend
    store = dist.FileStore(os.fspath(scratch / f"store-{os.getpid()}"), 1)
    options: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(0)
        options["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **options)
    return backend


def mib(value: float | None) -> str:
    """Bytes as MiB with no decimals, ``-`` when not measured."""
    return "-" if value is None else f"{value / MiB:,.0f}"


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, ``-`` when not measured."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def spread_ms(timings: Timings, name: str) -> str:
    """A variant's median step in ms with the range of its rounds."""
    return timings.spread(name).format(" ms", scale=1e3, digits=1)


def ratio(timings: Timings, name: str, reference: str) -> str:
    """The median of the per-round ratios of ``name`` over ``reference``, with their range."""
    return timings.ratio(name, reference).format(digits=3)
