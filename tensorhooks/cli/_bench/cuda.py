"""The CUDA part of the bench: a transformer stack under save_on_cpu and offload_parameters.

Step time and peak memory of each mode, timed in interleaved rounds (see
NOTE [How tensorhooks times things]). Both run on any device (the tests run them on CPU, where
peak memory reads 0).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import graph as torch_graph

import tensorhooks
from tensorhooks.cli._harness import interleaved
from tensorhooks.cli._models import ModelConfig, TinyTransformer, backward, make_batch

from .results import BenchOptions, GpuRow

__all__ = ["OFFLOAD_CONFIG", "run_offload", "run_offload_parameters"]

OFFLOAD_CONFIG = ModelConfig(batch=8, seq=512, d_model=1024, heads=16, layers=12, device="cuda")


def run_offload(
    options: BenchOptions,
    config: ModelConfig = OFFLOAD_CONFIG,
    advance: Callable[[int], None] | None = None,
) -> list[GpuRow]:
    """A transformer stack under no offload, torch's save_on_cpu and tensorhooks'.

    Runs on any device (the tests run it on CPU, where peak memory reads 0); the bench runs it
    on CUDA with `OFFLOAD_CONFIG`, a quarter of the CPU bench's steps per round.
    """
    cuda = config.device.startswith("cuda")
    torch.manual_seed(config.seed)
    model = TinyTransformer(config).to(config.device)
    batch = make_batch(config)
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "no offload": contextlib.nullcontext,
        "torch save_on_cpu": partial(torch_graph.save_on_cpu, pin_memory=cuda),
        "tensorhooks save_on_cpu": partial(tensorhooks.save_on_cpu, pin_memory=cuda),
    }

    def step_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=False)
            with context():
                backward(model(*batch))

        return step

    steps = {name: step_under(context) for name, context in contexts.items()}
    peaks = dict.fromkeys(steps, 0)
    for name, step in steps.items():
        step()  # warm-up; gradients stay allocated, so they are not counted as activations
        if cuda:
            peaks[name] = _peak_bytes(step, above_allocated=True)
    timings = interleaved(
        steps, rounds=options.rounds, inner=max(1, options.steps // 4), progress=advance
    )
    return [GpuRow(name, timings.spread(name), peaks[name]) for name in contexts]


def _peak_bytes(step: Callable[[], None], *, above_allocated: bool) -> int:
    """Peak CUDA memory of one ``step``, optionally above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if above_allocated else 0
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_offload_parameters(
    options: BenchOptions,
    config: ModelConfig = OFFLOAD_CONFIG,
    transfer: tensorhooks.ParameterTransfer | None = None,
    advance: Callable[[int], None] | None = None,
) -> list[GpuRow]:
    """A transformer stack with its parameters resident and under offload_parameters.

    Peak device memory is the whole of a step's peak (weights, gradients and activations), as
    offloading parameters is what lowers it. Runs on any device with ``transfer`` (the tests run
    it on CPU with host copies, where peak memory reads 0); the bench runs it on CUDA with
    `OFFLOAD_CONFIG` and CUDA side streams, a quarter of the CPU bench's steps per round.
    """
    cuda = config.device.startswith("cuda")
    torch.manual_seed(config.seed)
    resident = TinyTransformer(config).to(config.device)
    offloaded = copy.deepcopy(resident)
    if transfer is None:
        handle = tensorhooks.offload_parameters(offloaded, device=config.device)
    else:
        handle = tensorhooks.offload_parameters(offloaded, transfer=transfer)
    batch = make_batch(config)

    def step_of(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=False)
            backward(model(*batch))

        return step

    steps = {
        "resident": step_of(resident),
        "tensorhooks offload_parameters": step_of(offloaded),
    }
    try:
        peaks = dict.fromkeys(steps, 0)
        for name, step in steps.items():
            step()  # warm-up: gradients are allocated from here on
            if cuda:
                peaks[name] = _peak_bytes(step, above_allocated=False)
        timings = interleaved(
            steps, rounds=options.rounds, inner=max(1, options.steps // 4), progress=advance
        )
    finally:
        handle.remove()
    return [GpuRow(name, timings.spread(name), peaks[name]) for name in steps]
