"""What save_on_cpu costs when every saved tensor is already on the CPU, in a training loop.

Times the step of a training loop as people write it (``optimizer.zero_grad()``, the forward pass
under a context made for this step, ``loss.backward()``, ``optimizer.step()``), with the cyclic
garbage collector on, on one thread, under several settings in interleaved rounds (the harness of
tensorhooks.cli._harness), and prints medians, per-round ratios and their range. Three loops:

- a 50-layer Linear(64, 64)+ReLU MLP at batch 8, one context around the forward pass;
- the same MLP with one context per Linear+ReLU (docs/save_on_cpu.md: one per layer works), where
  what entering a context costs is paid 50 times a step;
- a tiny Llama/Mixtral-style transformer (rotary attention, RMSNorm, SwiGLU, top-2 mixture of
  experts, causal-LM loss), one context around the forward pass.

Settings:

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

Wall-clock ratios on a loaded machine move by several percent between runs, and a few rounds of
one variant can land far from the others. Instruction counts do not: ``benchmarks/instructions.py
ours_offload`` and ``torch_offload`` (with ``--optimizer``, and ``--model mlp --per-layer``) count
the same steps under callgrind.

Run: python benchmarks/offload_cpu.py [--rounds 40] [--steps 5] [--loop mlp|per-layer|transformer]
    [--no-optimizer]
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

import tensorhooks
from tensorhooks.cli._harness import check_target, interleaved, print_table
from tensorhooks.cli._models import LlamaConfig, TinyLlama, make_tokens, mlp

Context = Callable[[], AbstractContextManager[object]]
Forward = Callable[[Context], torch.Tensor]


def mlp_forward(
    layers: int, width: int, batch: int, *, per_layer: bool
) -> tuple[nn.Module, Forward]:
    """The MLP and its loss under a context: around the whole forward pass, or each layer."""
    model = mlp(layers, width)
    x = torch.randn(batch, width)
    blocks = [model[index : index + 2] for index in range(0, len(model), 2)]

    def whole(context: Context) -> torch.Tensor:
        with context():
            return model(x).sum()

    def each_layer(context: Context) -> torch.Tensor:
        h = x
        for block in blocks:
            with context():
                h = block(h)
        return h.sum()

    return model, each_layer if per_layer else whole


def transformer_forward() -> tuple[nn.Module, Forward]:
    """The tiny transformer and its causal-LM loss under a context."""
    config = LlamaConfig()
    model = TinyLlama(config)
    tokens = make_tokens(config)

    def forward(context: Context) -> torch.Tensor:
        with context():
            return model(tokens)  # type: ignore[no-any-return]

    return model, forward


def training_step(
    model: nn.Module, forward: Forward, *, optimizer: bool
) -> Callable[[Context], Callable[[], None]]:
    """A step as a training loop writes it, for each context factory.

    The optimizer is SGD with a learning rate of 0: it runs every operation of a step (one update
    per parameter) and leaves the weights as they are, so every setting computes on the same
    numbers however many steps the others took (no drift towards denormals or overflow).
    """
    sgd = torch.optim.SGD(model.parameters(), lr=0.0) if optimizer else None

    def step_fn(context: Context) -> Callable[[], None]:
        def step() -> None:
            # torch.utils.benchmark.Timer, like timeit, turns the cyclic garbage collector off
            # while it times; a training loop runs with it on, and collecting what a step left
            # behind (a reference cycle per context entry, say) is part of the step's cost.
            gc.enable()
            model.zero_grad(set_to_none=True)
            forward(context).backward()  # type: ignore[no-untyped-call]  # untyped in torch
            if sgd is not None:
                sgd.step()

        return step

    return step_fn


def compare(
    label: str,
    title: str,
    step_fn: Callable[[Context], Callable[[], None]],
    rounds: int,
    steps: int,
) -> None:
    """Time every setting under ``step_fn``, print the table and the ratios, check the target."""
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
        {name: step_fn(context) for name, context in variants.items()},
        rounds=rounds,
        inner=steps,
        warmup=2,
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
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5, help="steps per setting and round")
    parser.add_argument(
        "--loop", choices=("mlp", "per-layer", "transformer"), help="one loop only (default: all)"
    )
    parser.add_argument(
        "--no-optimizer", action="store_true", help="forward and backward only, no optimizer step"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    optimizer = not args.no_optimizer
    what = "zero_grad, fwd, bwd, SGD step" if optimizer else "zero_grad, fwd, bwd"
    mlp_name = f"{args.layers}x(Linear({args.width}, {args.width}) + ReLU), batch {args.batch}"
    loops: dict[str, tuple[str, Callable[[], tuple[nn.Module, Forward]]]] = {
        "mlp": (
            f"MLP: {what} of {mlp_name}, one context",
            lambda: mlp_forward(args.layers, args.width, args.batch, per_layer=False),
        ),
        "per-layer": (
            f"MLP: {what} of {mlp_name}, one context per layer",
            lambda: mlp_forward(args.layers, args.width, args.batch, per_layer=True),
        ),
        "transformer": (
            (
                f"transformer: {what} of a tiny Llama/Mixtral-style model (4 layers, d_model "
                "64, 2 MoE layers of 4 experts top-2), batch 2 x 32 tokens, one context"
            ),
            transformer_forward,
        ),
    }
    for label, (title, build) in loops.items():
        if args.loop in (None, label):
            model, forward = build()
            compare(
                label,
                title,
                training_step(model, forward, optimizer=optimizer),
                args.rounds,
                args.steps,
            )


if __name__ == "__main__":
    main()
