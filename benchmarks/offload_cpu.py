"""What save_on_cpu costs when every saved tensor is already on the CPU.

Times one fwd+bwd step of a 50-layer Linear(64, 64)+ReLU MLP at batch 8, and of a tiny
Llama/Mixtral-style transformer (rotary attention, RMSNorm, SwiGLU, top-2 mixture of experts,
causal-LM loss), on one thread under six settings, in interleaved rounds (the harness of
tensorhooks.cli._harness), and prints medians, per-round ratios and their range:

- ``plain``: no hooks;
- ``identity``: tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t), the floor any pair of
  hooks pays. This pair keeps a reference cycle through every output saved by its own node, so a
  graph dropped without backward is never freed;
- ``identity, detach``: the same with ``lambda t: t.detach()`` as pack, the pair torch's docs
  recommend to avoid that cycle; save_on_cpu is cycle-free too (it detaches saved outputs only);
- ``tensorhooks``: tensorhooks.save_on_cpu() (``pin_memory=True`` takes the same path here);
- ``torch``: torch.autograd.graph.save_on_cpu() (which does not copy CPU tensors either, and
  does not guard them against in-place changes);
- ``torch pinned``: torch.autograd.graph.save_on_cpu(pin_memory=True), which copies them.

Target: tensorhooks no slower than torch's save_on_cpu (median per-round ratio <= 1.00).

Run: python benchmarks/offload_cpu.py [--rounds 30] [--steps 10] [--model mlp|transformer]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

import tensorhooks
from tensorhooks.cli._harness import check_target, interleaved, print_table
from tensorhooks.cli._models import LlamaConfig, TinyLlama, make_tokens, mlp

Context = Callable[[], AbstractContextManager[object]]


def mlp_step(layers: int, width: int, batch: int) -> Callable[[Context], Callable[[], None]]:
    model = mlp(layers, width)
    x = torch.randn(batch, width)
    params = list(model.parameters())

    def step_fn(context: Context) -> Callable[[], None]:
        def step() -> None:
            with context():
                loss = model(x).sum()
            torch.autograd.grad(loss, params)

        return step

    return step_fn


def transformer_step() -> Callable[[Context], Callable[[], None]]:
    config = LlamaConfig()
    model = TinyLlama(config)
    tokens = make_tokens(config)
    params = list(model.parameters())

    def step_fn(context: Context) -> Callable[[], None]:
        def step() -> None:
            with context():
                loss = model(tokens)
            torch.autograd.grad(loss, params, allow_unused=True)

        return step

    return step_fn


def compare(
    label: str,
    title: str,
    step_fn: Callable[[Context], Callable[[], None]],
    rounds: int,
    steps: int,
) -> None:
    identity = tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)
    identity_detach = tensorhooks.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)
    variants: dict[str, Context] = {
        "plain": nullcontext,
        "identity": lambda: identity,
        "identity, detach": lambda: identity_detach,
        "tensorhooks": tensorhooks.save_on_cpu,
        "torch": torch.autograd.graph.save_on_cpu,
        "torch pinned": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    }
    timings = interleaved(
        {name: step_fn(context) for name, context in variants.items()}, rounds=rounds, inner=steps
    )
    print_table(
        f"{title}, 1 thread, {rounds} interleaved rounds of {steps} steps", timings, "torch"
    )
    for reference in ("identity", "identity, detach", "torch", "torch pinned"):
        print(
            f"tensorhooks / {reference}: {timings.ratio('tensorhooks', reference).format(digits=3)}"
        )
    check_target(
        f"save_on_cpu on CPU tensors ({label}), tensorhooks / torch",
        timings.ratio("tensorhooks", "torch"),
        at_most=1.00,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=("mlp", "transformer"), help="one model only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model in (None, "mlp"):
        compare(
            "MLP",
            f"MLP: fwd+bwd of {args.layers}x(Linear({args.width}, {args.width}) + ReLU), "
            f"batch {args.batch}",
            mlp_step(args.layers, args.width, args.batch),
            args.rounds,
            args.steps,
        )
    if args.model in (None, "transformer"):
        compare(
            "transformer",
            "transformer: fwd+bwd of a tiny Llama/Mixtral-style model (4 layers, d_model 64, "
            "2 MoE layers of 4 experts top-2), batch 2 x 32 tokens",
            transformer_step(),
            args.rounds,
            args.steps,
        )


if __name__ == "__main__":
    main()
