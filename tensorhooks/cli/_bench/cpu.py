"""The CPU part of the bench: every feature against torch on the reference workloads, one thread.

Forward + backward of 50 x Linear(64, 64) + ReLU, batch 8 (also under tensorhooks' and torch's
non-reentrant checkpoint, one region per layer), and of a tiny Llama/Mixtral-style transformer
(`TinyLlama`), every variant timed in the same interleaved rounds (see
NOTE [How tensorhooks times things]); each row a ratio over plain autograd and over torch,
with the design's targets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import graph as torch_graph
from torch.utils import checkpoint as torch_checkpoint

import tensorhooks
from tensorhooks.cli._harness import interleaved
from tensorhooks.cli._models import LlamaConfig, NoOpMode, TinyLlama, backward, make_tokens, mlp

from .results import BenchOptions, Comparison, Target, compare

__all__ = ["ROWS", "cpu_variants", "round_seconds", "run_cpu"]


def _checkpointed_step(
    model: nn.Sequential, batch: torch.Tensor, checkpoint: Callable[..., Any]
) -> Callable[[], None]:
    """A step of ``model`` (Linear, ReLU, ...) with each Linear + ReLU one checkpointed region."""
    regions = [nn.Sequential(model[i], model[i + 1]) for i in range(0, len(model), 2)]

    def step() -> None:
        hidden = batch
        for region in regions:
            hidden = checkpoint(region, hidden)
        backward(hidden.square().mean())

    return step


def cpu_variants() -> dict[str, Callable[[], None]]:
    """Every variant the CPU part times, by name: what `run_cpu` runs."""
    model = mlp(50)
    batch = torch.randn(8, 64)

    def step_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]], net: Any
    ) -> Callable[[], None]:
        def step() -> None:
            with context():
                backward(net(batch).square().mean())

        return step

    def identity(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    variants = {
        "plain": step_under(contextlib.nullcontext, model),
        "torch hooks": step_under(
            lambda: torch_graph.saved_tensors_hooks(identity, identity), model
        ),
        "ours hooks": step_under(
            lambda: tensorhooks.saved_tensors_hooks(identity, identity), model
        ),
        "torch offload": step_under(torch_graph.save_on_cpu, model),
        "ours offload": step_under(tensorhooks.save_on_cpu, model),
        "torch mutation": step_under(torch_graph.allow_mutation_on_saved_tensors, model),
        "ours mutation": step_under(tensorhooks.allow_mutation_on_saved_tensors, model),
        "no-op mode": step_under(NoOpMode, model),
        "torch checkpoint": _checkpointed_step(
            model, batch, partial(torch_checkpoint.checkpoint, use_reentrant=False)
        ),
        "ours checkpoint": _checkpointed_step(
            model, batch, partial(tensorhooks.checkpoint, use_reentrant=False)
        ),
    }
    # One layer's weight and bias per bucket: 100 parameters in 50 buckets, hooks kept registered.
    for name, register in (
        ("torch multigrad", torch_graph.register_multi_grad_hook),
        ("ours multigrad", tensorhooks.register_multi_grad_hook),
    ):
        hooked = mlp(50)
        parameters = list(hooked.parameters())
        for index in range(0, len(parameters), 2):
            register(parameters[index : index + 2], lambda grads: None)
        variants[name] = step_under(contextlib.nullcontext, hooked)
    # The tiny Llama/Mixtral-style transformer: more operators per saved tensor, in-place writes.
    config = LlamaConfig()
    llama = TinyLlama(config)
    tokens = make_tokens(config)

    def llama_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Callable[[], None]:
        def step() -> None:
            llama.zero_grad(set_to_none=True)
            with context():
                backward(llama(tokens))

        return step

    variants |= {
        "plain llama": llama_under(contextlib.nullcontext),
        "torch hooks llama": llama_under(
            lambda: torch_graph.saved_tensors_hooks(identity, identity)
        ),
        "ours hooks llama": llama_under(
            lambda: tensorhooks.saved_tensors_hooks(identity, identity)
        ),
        "torch offload llama": llama_under(torch_graph.save_on_cpu),
        "ours offload llama": llama_under(tensorhooks.save_on_cpu),
        "torch mutation llama": llama_under(torch_graph.allow_mutation_on_saved_tensors),
        "ours mutation llama": llama_under(tensorhooks.allow_mutation_on_saved_tensors),
    }
    return variants


# (mode, torch's variant, ours, targets[, plain autograd's variant]); targets from the
# project's design. Rows without a fifth entry are on the MLP, whose plain variant is "plain".
ROWS: list[tuple[Any, ...]] = [
    ("saved_tensors_hooks", "torch hooks", "ours hooks",
     (Target("ours hooks", "torch hooks", 1.10, "x torch"),)),
    ("register_multi_grad_hook", "torch multigrad", "ours multigrad",
     (Target("ours multigrad", "torch multigrad", 1.10, "x torch"),)),
    ("save_on_cpu (CPU tensors)", "torch offload", "ours offload",
     (Target("ours offload", "ours hooks", 1.05, "x identity hooks"),)),
    ("allow_mutation_on_saved_tensors", "torch mutation", "ours mutation",
     (Target("ours mutation", "torch mutation", 1 / 1.6, "x torch"),
      Target("ours mutation", "no-op mode", 1.15, "x no-op mode"))),
    ("checkpoint (non-reentrant)", "torch checkpoint", "ours checkpoint",
     (Target("ours checkpoint", "torch checkpoint", 1.05, "x torch"),)),
    ("reference: no-op TorchDispatchMode", "no-op mode", None, ()),
    ("transformer: saved_tensors_hooks", "torch hooks llama", "ours hooks llama",
     (Target("ours hooks llama", "torch hooks llama", 1.10, "x torch"),), "plain llama"),
    ("transformer: save_on_cpu (CPU tensors)", "torch offload llama", "ours offload llama",
     (Target("ours offload llama", "torch offload llama", 1.00, "x torch"),), "plain llama"),
    ("transformer: allow_mutation_on_saved_tensors", "torch mutation llama",
     "ours mutation llama",
     (Target("ours mutation llama", "torch mutation llama", 1 / 1.6, "x torch"),),
     "plain llama"),
]  # fmt: skip


def round_seconds(variants: Mapping[str, Callable[[], object]], steps: int) -> float:
    """About how long one interleaved round of ``variants`` takes: a warm call of each, timed.

    A round calls each variant ``steps`` times plus two warm-up calls (``Timer.timeit``), on one
    intra-op thread; this times one call each after a first, on one thread too.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = 0.0
        for fn in variants.values():
            fn()
            started = time.perf_counter()
            fn()
            total += time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    return total * (steps + 2)


def run_cpu(
    options: BenchOptions,
    advance: Callable[[int], None] | None = None,
    variants: Mapping[str, Callable[[], object]] | None = None,
) -> list[Comparison]:
    """Time every feature on the CPU reference workload, one intra-op thread.

    ``variants`` are `cpu_variants` (built here unless given).
    """
    timings = interleaved(
        cpu_variants() if variants is None else variants,
        rounds=options.rounds,
        inner=options.steps,
        progress=advance,
    )
    return [
        compare(timings, mode, theirs, ours, targets, plain=rest[0] if rest else "plain")
        for mode, theirs, ours, targets, *rest in ROWS
    ]
