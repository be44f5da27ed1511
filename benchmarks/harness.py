"""What the benchmark scripts share: interleaved timing and the MLP most of them time.

Interleaved timing: every variant runs once per round, in a rotating order; medians compared.

Machines that run these benchmarks are noisy, so absolute times mean little. Ratios between
variants measured in the same process, interleaved round by round, are what the docs report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def interleaved_medians(
    variants: dict[str, Callable[[], object]], *, rounds: int = 30, inner: int = 10, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each variant, measured interleaved over ``rounds`` rounds."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_table(title: str, medians: dict[str, float], baseline: str) -> None:
    """Print each variant's median and its ratio to ``baseline``."""
    print(f"\n{title}")
    print(f"| variant | median step (ms) | ratio to {baseline} |")
    print("|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e3:.3f} | {seconds / medians[baseline]:.3f} |")


def mlp(layers: int, width: int = 64, *, last_relu: bool = True) -> nn.Sequential:
    """``layers`` x (Linear(width, width), ReLU), seeded; ``last_relu=False`` drops the last."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*(blocks if last_relu else blocks[:-1]))
