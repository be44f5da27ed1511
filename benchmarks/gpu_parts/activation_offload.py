"""save_on_cpu(pin_memory=True) on a bf16 transformer stack, against no offload and torch's.

On one GPU, one fwd+bwd step (``torch.autograd.grad`` of a scalar loss over the input and every
parameter) of a stack of pre-norm blocks with causal flash attention, under three settings:
``none`` (plain autograd), ``torch`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``)
and ``tensorhooks`` (``tensorhooks.save_on_cpu(pin_memory=True)``). In this order, so that the
most important figures come first when time is short:

1. gradients of each setting against no offload's, and no offload's against itself (flash
   attention's backward is not deterministic, so that is the noise);
2. peak device memory of a step above the memory before it (the activations, and the
   gradients ``autograd.grad`` returns, the same in every setting);
3. the bytes each offloading setting moves each way per step (tensorhooks' own counters;
   for torch's, every saved tensor once at pack and once at unpack), and the time the profiler
   sees device-to-host and host-to-device copies take in a step, against a plain pinned copy
   of 256 MiB each way: the achieved bandwidth;
4. step time, interleaved rounds timed by CUDA events;
5. the design targets: at least 70% less peak activation memory than no offload; copies at
   at least 80% of the pinned bandwidth; a step within 1.10x of its physical bound, the larger
   of the step without offload and the copy time at the pinned bandwidth (both directions);
   faster than torch's at no more memory (its peak at most 5% over torch's); and the gradients
   equal to no offload's (bit for bit, or within the noise).

Size on the GPU: 12 blocks, d=1024, 16 heads, sequence 4096, batch 4 (16,384 tokens), bf16:
about 6.8 GB of saved activations per step, so the copies take about 0.14 s each way on a
PCIe Gen5 link and a step without offload tens of milliseconds: the copies, not launches, set
the pace. A dry run uses 2 blocks of d=64 on the CPU, where nothing is copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from harness import FusedAttentionBlock, interleaved
from offload_gpu import SavedBytes, memcpy_seconds
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import tensorhooks

from . import common
from .common import GB, GRADIENT_COLUMNS, attempt, gradient_row, mib, ms, peak_above
from .record import FAILED, OK, Recorder, evaluate

PART = "save_on_cpu"


@dataclass(frozen=True)
class Size:
    """The model, its batch, and how long to time it."""

    layers: int
    d: int
    heads: int
    seq: int
    batch: int
    rounds: int
    inner: int

    def describe(self) -> str:
        return (
            f"{self.layers} blocks, d={self.d}, {self.heads} heads, sequence {self.seq}, batch "
            f"{self.batch}, bf16"
        )


GPU_SIZE = Size(layers=12, d=1024, heads=16, seq=4096, batch=4, rounds=5, inner=2)
DRY_SIZE = Size(layers=2, d=64, heads=4, seq=32, batch=2, rounds=2, inner=1)
PINNED_COPY_BYTES = 256 << 20


def build(size: Size, device: str) -> tuple[nn.Module, torch.Tensor]:
    """The stack and its input, seeded."""
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(
            *(FusedAttentionBlock(size.d, size.heads) for _ in range(size.layers))
        )
        x = torch.randn(size.batch, size.seq, size.d)
    return model.to(torch.bfloat16), x.to(torch.bfloat16).requires_grad_()


def contexts(pin: bool) -> dict[str, Callable[[], AbstractContextManager[Any]]]:
    """Each setting's context, entered around the forward pass."""
    return {
        "none": nullcontext,
        "torch": lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin),
        "tensorhooks": lambda: tensorhooks.save_on_cpu(pin_memory=pin),
    }


def gradients(
    model: nn.Module, x: torch.Tensor, context: Callable[[], AbstractContextManager[Any]]
) -> tuple[torch.Tensor, ...]:
    """One step: the gradients of the loss with respect to the input and every parameter."""
    with context():
        loss = model(x).float().square().mean()
    return torch.autograd.grad(loss, [x, *model.parameters()])


def forward_keeps(
    model: nn.Module,
    x: torch.Tensor,
    context: Callable[[], AbstractContextManager[Any]],
    device: str,
) -> int | None:
    """Device bytes held after the forward pass until backward (what offloading frees)."""
    before = common.allocated(device)
    with context():
        loss = model(x).float().square().mean()
    after = common.allocated(device)
    torch.autograd.grad(loss, [x, *model.parameters()])
    return None if before is None or after is None else after - before


def pinned_bandwidth(device: str) -> tuple[float | None, float | None]:
    """Bytes per second of a plain pinned copy of 256 MiB, device-to-host and host-to-device."""
    if device != "cuda":
        return None, None
    on_device = torch.empty(PINNED_COPY_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.empty(PINNED_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    timings = interleaved(
        {
            "D2H": lambda: host.copy_(on_device, non_blocking=True),
            "H2D": lambda: on_device.copy_(host, non_blocking=True),
        },
        rounds=5,
        inner=3,
        cuda_events=True,
    )
    return PINNED_COPY_BYTES / timings.median("D2H"), PINNED_COPY_BYTES / timings.median("H2D")


def copy_seconds(step: Callable[[], object], device: str) -> tuple[float | None, float | None]:
    """Device time the profiler sees device-to-host and host-to-device copies take in a step."""
    if device != "cuda":
        step()
        return None, None
    return memcpy_seconds(step)


def bytes_moved(
    model: nn.Module, x: torch.Tensor, device: str, pin: bool
) -> dict[str, tuple[int, int]]:
    """Bytes each setting copies device-to-host and host-to-device in one step."""
    counter = SavedBytes()
    gradients(model, x, counter.hooks)
    before = tensorhooks.save_on_cpu.stats(device)
    gradients(model, x, contexts(pin)["tensorhooks"])
    common.synchronize(device)
    after = tensorhooks.save_on_cpu.stats(device)
    return {
        "none": (0, 0),
        "torch": (counter.packed, counter.unpacked),
        "tensorhooks": (
            after.bytes_to_host - before.bytes_to_host,
            after.bytes_to_device - before.bytes_to_device,
        ),
    }


def _share(value: float | None, of: float | None) -> str:
    if value is None or not of:
        return "-"
    return f"{value / GB:.1f} ({value / of:.0%})"


class _Run:
    """The model and settings being measured, and what was measured so far (None: not yet)."""

    def __init__(self, size: Size, device: str) -> None:
        self.size = size
        self.device = device
        self.pin = device == "cuda"
        self.model, self.x = build(size, device)
        self.settings = contexts(self.pin)
        self.steps = {
            name: (lambda c=context: gradients(self.model, self.x, c))
            for name, context in self.settings.items()
        }
        self.working: dict[str, Callable[[], object]] = {}
        self.peak: dict[str, int | None] = {}
        self.keeps: dict[str, int | None] = {}
        self.moved: dict[str, tuple[int, int]] = {}
        self.copies: dict[str, tuple[float | None, float | None]] = {}
        self.pinned: tuple[float | None, float | None] = (None, None)
        self.median: dict[str, float] = {}
        self.ratio_to_torch: float | None = None
        self.gradients: dict[str, str] = {}
        self.deterministic: dict[str, str] = {}
        self.errors: dict[str, str] = {}


def run(rec: Recorder, ctx: Any) -> None:
    """Measure, record the tables, evaluate the targets."""
    size = DRY_SIZE if ctx.dry_run else GPU_SIZE
    rec.note(
        f"{size.describe()}; one step is forward, then `torch.autograd.grad` over the input and "
        "every parameter. tensorhooks' save_on_cpu with its defaults (prefetch 2, at most 4 "
        "copies in flight, tensors under 1 MiB and parameters stay on the device)."
    )
    found = _Run(size, ctx.device)
    errors = found.errors
    for name, step in found.steps.items():  # warm up: kernels, allocator, pinned pools
        if attempt(name, errors, lambda s=step: (s(), s())) is not None:
            found.working[name] = step
    # Each phase on its own: one that fails costs the others nothing.
    for phase in (_gradients, _memory_and_copies, _step_times):
        attempt(phase.__name__.strip("_"), errors, lambda p=phase: p(rec, found))
    _targets(rec, found)
    if errors:
        rec.table("Settings that failed", ["setting", "error"], list(map(list, errors.items())))
        rec.finish(FAILED, reason="failed: " + ", ".join(errors))
    else:
        rec.finish(OK)


def _gradients(rec: Recorder, found: _Run) -> None:
    """Each setting's gradients against no offload's, with flash attention, then bit for bit.

    Flash attention's backward is not deterministic, so no offload's run-to-run difference is
    the noise (the largest over two more runs: one pair is a thin sample of it). Then the same
    comparison on a smaller stack with every kernel deterministic (the math attention), where a
    correct offload gives no offload's gradients bit for bit unless a layout changed a kernel.
    """
    model, x, settings = found.model, found.x, found.settings
    reference = gradients(model, x, settings["none"])
    noise = max(
        common.max_difference(gradients(model, x, settings["none"]), reference) for _ in range(2)
    )
    rows = []
    for name in ("torch", "tensorhooks"):
        if name in found.working:
            got = attempt(
                f"{name} gradients", found.errors, lambda n=name: gradients(model, x, settings[n])
            )
            if got is not None:
                row, found.gradients[name] = gradient_row(name, got, reference, noise)
                rows.append(row)
    rec.table("Gradients against no offload's (input and every parameter)", GRADIENT_COLUMNS, rows)
    attempt("deterministic gradients", found.errors, lambda: _deterministic(rec, found))


def _deterministic(rec: Recorder, found: _Run) -> None:
    size = dataclasses.replace(found.size, layers=min(found.size.layers, 4))
    size = dataclasses.replace(size, seq=min(size.seq, 1024))
    model, x = build(size, found.device)
    settings = found.settings
    with sdpa_kernel([SDPBackend.MATH]):
        reference = gradients(model, x, settings["none"])
        noise = common.max_difference(gradients(model, x, settings["none"]), reference)
        rows = []
        for name in ("torch", "tensorhooks"):
            if name in found.working:
                got = gradients(model, x, settings[name])
                row, found.deterministic[name] = gradient_row(name, got, reference, noise)
                rows.append(row)
    rec.table(
        f"Gradients with deterministic kernels (math attention; {size.describe()})",
        GRADIENT_COLUMNS,
        rows,
    )


def _memory_and_copies(rec: Recorder, found: _Run) -> None:
    device, working = found.device, found.working
    for name, step in working.items():
        found.peak[name] = peak_above(step, device)[0]
        found.keeps[name] = forward_keeps(found.model, found.x, found.settings[name], device)
    errors = found.errors
    if "tensorhooks" in working:
        moved = attempt(
            "bytes moved", errors, lambda: bytes_moved(found.model, found.x, device, found.pin)
        )
        found.moved = moved or {}
    found.pinned = attempt("pinned copy", errors, lambda: pinned_bandwidth(device)) or (None, None)
    for name in ("torch", "tensorhooks"):
        if name in working:
            seconds = attempt(
                f"{name} profile", errors, lambda n=name: copy_seconds(working[n], device)
            )
            found.copies[name] = seconds or (None, None)
    pinned_d2h, pinned_h2d = found.pinned
    base = found.peak.get("none")
    rows = []
    for name in working:
        peak = found.peak[name]
        less = "-" if peak is None or not base else f"{1 - peak / base:.0%}"
        d2h, h2d = found.moved.get(name, (0, 0))
        d2h_s, h2d_s = found.copies.get(name, (None, None))
        rows.append(
            [
                name,
                mib(peak),
                less,
                mib(found.keeps[name]),
                f"{d2h / GB:.2f}",
                f"{h2d / GB:.2f}",
                _share(d2h / d2h_s if d2h_s else None, pinned_d2h),
                _share(h2d / h2d_s if h2d_s else None, pinned_h2d),
            ]
        )
    rec.table(
        "Peak activation memory and copies per step",
        [
            "setting",
            "peak above weights and input (MiB)",
            "less than none",
            "held after forward (MiB)",
            "D2H GB",
            "H2D GB",
            "D2H GB/s (of pinned)",
            "H2D GB/s (of pinned)",
        ],
        rows,
        notes=[
            (
                "The peak holds the activations and the gradients the step returns (the same "
                "in every setting); 'held after forward' is what the forward keeps on the device "
                f"for backward. Plain pinned copy of 256 MiB: D2H {_gbs(pinned_d2h)} GB/s, "
                f"H2D {_gbs(pinned_h2d)} GB/s. Copy bandwidth is bytes moved over the time the "
                "profiler saw the copies run."
            )
        ],
    )
    rec.put("peak_bytes", found.peak)
    rec.put("forward_keeps_bytes", found.keeps)
    rec.put("bytes_moved", found.moved)
    rec.put("copy_seconds", found.copies)
    rec.put("pinned_bytes_per_s", found.pinned)


def _gbs(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.1f}"


def _step_times(rec: Recorder, found: _Run) -> None:
    size, device, working = found.size, found.device, found.working
    timings = common.timed_rounds(working, rounds=size.rounds, inner=size.inner, device=device)
    found.median = {name: timings.median(name) for name in working}
    rows = [
        [
            name,
            common.spread_ms(timings, name),
            common.ratio(timings, name, "none") if "none" in working else "-",
            common.ratio(timings, name, "torch") if "torch" in working else "-",
        ]
        for name in working
    ]
    if {"torch", "tensorhooks"} <= working.keys():
        found.ratio_to_torch = timings.ratio("tensorhooks", "torch").median
    rounds = len(next(iter(timings.samples.values()), []))
    rec.table(
        f"Step time, median (min-max) of {rounds} interleaved rounds x {size.inner} steps",
        ["setting", "step", "x none", "x torch"],
        rows,
    )
    rec.put("step_seconds", timings.samples)


def _targets(rec: Recorder, found: _Run) -> None:
    peak_none, peak_ours = found.peak.get("none"), found.peak.get("tensorhooks")
    less = 1 - peak_ours / peak_none if peak_none and peak_ours is not None else None
    rec.target(
        evaluate(
            PART,
            "peak activation memory, less than no offload",
            less,
            at_least=0.70,
            fmt="{:.0%}",
            detail=f"peak {mib(peak_ours)} MiB against {mib(peak_none)} MiB; held after forward "
            f"{mib(found.keeps.get('tensorhooks'))} MiB against {mib(found.keeps.get('none'))} MiB",
        )
    )
    d2h, h2d = found.moved.get("tensorhooks", (0, 0))
    d2h_s, h2d_s = found.copies.get("tensorhooks", (None, None))
    pinned_d2h, pinned_h2d = found.pinned
    shares = []
    if d2h_s and pinned_d2h and h2d_s and pinned_h2d:
        shares = [d2h / d2h_s / pinned_d2h, h2d / h2d_s / pinned_h2d]
    rec.target(
        evaluate(
            PART,
            "copy bandwidth, share of pinned (the lower direction)",
            min(shares) if shares else None,
            at_least=0.80,
            fmt="{:.0%}",
            detail=f"D2H {_share(d2h / d2h_s if d2h_s else None, pinned_d2h)} GB/s, H2D "
            f"{_share(h2d / h2d_s if h2d_s else None, pinned_h2d)} GB/s",
        )
    )
    _bound_target(rec, found, d2h, h2d)
    _torch_target(rec, found)
    rec.target(
        common.gradient_target(
            PART,
            "gradients equal to no offload's",
            found.gradients.get("tensorhooks"),
            "tensorhooks' setting failed",
        )
    )
    rec.target(
        common.gradient_target(
            PART,
            "gradients equal to no offload's, deterministic kernels",
            found.deterministic.get("tensorhooks"),
            "the deterministic run failed",
        )
    )
    summary = []
    if less is not None:
        summary.append(f"{less:.0%} less activation memory")
    if found.ratio_to_torch is not None:
        summary.append(f"{found.ratio_to_torch:.2f}x torch's step")
    if "tensorhooks" in found.median and "none" in found.median:
        summary.append(f"{found.median['tensorhooks'] / found.median['none']:.2f}x no offload")
    rec.summary(", ".join(summary))


def _bound_target(rec: Recorder, found: _Run, d2h: int, h2d: int) -> None:
    pinned_d2h, pinned_h2d = found.pinned
    ours, none = found.median.get("tensorhooks"), found.median.get("none")
    value = detail = None
    if ours and none and pinned_d2h and pinned_h2d:
        copy_time = d2h / pinned_d2h + h2d / pinned_h2d
        bound = max(none, copy_time)
        value = ours / bound
        limit = "the copies (the link)" if copy_time > none else "the compute"
        detail = (
            f"step {ms(ours)} ms; no offload {ms(none)} ms; copies {d2h / GB:.2f} + "
            f"{h2d / GB:.2f} GB at pinned bandwidth {ms(copy_time)} ms: bound by {limit}"
        )
    rec.target(
        evaluate(
            PART,
            "step over its physical bound max(no offload, copy time)",
            value,
            at_most=1.10,
            fmt="{:.2f}x",
            detail=detail or "",
        )
    )


def _torch_target(rec: Recorder, found: _Run) -> None:
    ours, theirs = found.peak.get("tensorhooks"), found.peak.get("torch")
    ratio = found.ratio_to_torch
    memory_ok = ours is not None and theirs is not None and ours <= 1.05 * theirs
    value = None if ratio is None else ratio
    target = evaluate(
        PART,
        "step over torch's save_on_cpu, at no more memory",
        value,
        at_most=1.0,
        fmt="{:.3f}x",
        detail=f"peak {mib(ours)} MiB against torch's {mib(theirs)} MiB (at most 5% more)",
    )
    if target.met and not memory_ok and ours is not None:
        target = dataclasses.replace(target, met=False)
    rec.target(target)
