"""allow_mutation_on_saved_tensors: cost of a fwd+bwd step, against torch and a bare mode.

Model: 50 x Linear(64, 64) with ReLU between, batch 8, one intra-op thread. Every variant enters
its context once per step, as a training loop would; variants are interleaved round by round
(the harness in tensorhooks.cli._harness) and medians compared:

- ``plain autograd``: no context (for reference).
- ``bare mode``: a no-op TorchDispatchMode, ``__torch_dispatch__`` only calling
  ``func(*args, **(kwargs or {}))``: the floor for any TorchDispatchMode written that way.
- ``bare mode, no dynamo wrapper``: the same mode opting out of the ``torch._disable_dynamo``
  wrapper TorchDispatchMode puts around every subclass's handler, as tensorhooks does.
- ``torch``: ``torch.autograd.graph.allow_mutation_on_saved_tensors``.
- ``tensorhooks``: ``tensorhooks.allow_mutation_on_saved_tensors``.

Two scenarios: gradients set to None before each step (backward writes nothing in place), and
gradients accumulated across steps (backward adds into ``.grad`` in place: 100 writing ops per
step that the contexts must check).

The same two scenarios run on a tiny Llama/Mixtral-style transformer (rotary attention with a
causal mask, RMSNorm, SwiGLU, top-2 mixture of experts whose routing weights are renormalised in
place and whose experts' outputs are combined with ``index_add_``; causal-LM loss): real model
code has more operators per saved tensor, and writes in place in its forward pass.

Run: python benchmarks/mutation.py [--rounds N] [--model mlp|transformer]
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.graph as torch_graph
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks
from tensorhooks.cli._harness import Timings, check_target, interleaved, print_table
from tensorhooks.cli._models import LlamaConfig, NoOpMode, TinyLlama, make_tokens, mlp

BareMode = NoOpMode
TRANSFORMER = (
    "a tiny Llama/Mixtral-style transformer (4 layers, d_model 64, 4 heads, rotary, RMSNorm, "
    "SwiGLU, 2 MoE layers of 4 experts top-2; batch 2 x 32 tokens, causal-LM loss)"
)


class BareModeNoDynamoWrapper(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


CONTEXTS: dict[str, Callable[[], Any] | None] = {
    "plain autograd": None,
    "bare mode": BareMode,
    "bare mode, no dynamo wrapper": BareModeNoDynamoWrapper,
    "torch": torch_graph.allow_mutation_on_saved_tensors,
    "tensorhooks": tensorhooks.allow_mutation_on_saved_tensors,
}


def scenario(title: str, rounds: int, *, accumulate: bool, transformer: bool = False) -> Timings:
    if transformer:
        config = LlamaConfig()
        model: torch.nn.Module = TinyLlama(config)
        tokens = make_tokens(config)

        def loss() -> torch.Tensor:
            return model(tokens)  # type: ignore[no-any-return]
    else:
        model = mlp(50, last_relu=False)
        batch = torch.randn(8, 64)

        def loss() -> torch.Tensor:
            return model(batch).sum()  # type: ignore[no-any-return]

    params = list(model.parameters())

    def step(context: Callable[[], Any] | None) -> Callable[[], None]:
        def run() -> None:
            if not accumulate:
                for param in params:  # what zero_grad(set_to_none=True) does, 10x cheaper
                    param.grad = None
            if context is None:
                loss().backward()  # type: ignore[no-untyped-call]
                return
            with context():
                loss().backward()  # type: ignore[no-untyped-call]

        return run

    timings = interleaved(
        {name: step(context) for name, context in CONTEXTS.items()}, rounds=rounds
    )
    print_table(title, timings, "torch")
    speedup = timings.ratio("tensorhooks", "torch").reciprocal()
    print(f"speedup over torch's context per round: {speedup.format(digits=3)}")
    check_target("speedup over torch's context", speedup, at_least=1.6)
    check_target("ratio to the bare mode", timings.ratio("tensorhooks", "bare mode"), at_most=1.15)
    print(
        "ratio to the bare mode without its dynamo wrapper: "
        f"{timings.ratio('tensorhooks', 'bare mode, no dynamo wrapper').format()}"
    )
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--model", choices=("mlp", "transformer"), help="one model only")
    args = parser.parse_args()
    # Objects made at import time are not rescanned by every collection, for every variant.
    gc.collect()
    gc.freeze()
    if args.model in (None, "mlp"):
        scenario(
            "fwd+bwd of 50 x Linear(64, 64) + ReLU, batch 8, gradients set to None before each "
            "step",
            args.rounds,
            accumulate=False,
        )
        scenario(
            "the same, gradients accumulated in place across steps",
            args.rounds,
            accumulate=True,
        )
    if args.model in (None, "transformer"):
        scenario(
            f"fwd+bwd of {TRANSFORMER}, gradients set to None before each step",
            args.rounds,
            accumulate=False,
            transformer=True,
        )
        scenario(
            "the same transformer, gradients accumulated in place across steps",
            args.rounds,
            accumulate=True,
            transformer=True,
        )


if __name__ == "__main__":
    main()
