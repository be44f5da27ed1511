"""Cost of identity saved-tensor hooks and of multi-grad hooks, tensorhooks against torch.

Multi-grad hooks are timed in a step (registered once) and in their registration and removal.

Run: python benchmarks/hooks.py [--rounds N] [--only registration]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.graph as torch_graph

import tensorhooks
from tensorhooks.cli._harness import Timings, check_target, interleaved, print_table
from tensorhooks.cli._models import LlamaConfig, TinyLlama, make_tokens, mlp

TRANSFORMER = (
    "a tiny Llama/Mixtral-style transformer (4 layers, d_model 64, 4 heads, rotary, RMSNorm, "
    "SwiGLU, 2 MoE layers of 4 experts top-2; batch 2 x 32 tokens, causal-LM loss)"
)


def identity_hooks(rounds: int) -> Timings:
    model = mlp(50)
    batch = torch.randn(8, 64)

    def step(hooks: Callable[[], object] | None) -> Callable[[], None]:
        def run() -> None:
            if hooks is None:
                loss = model(batch).sum()
            else:
                with hooks():  # type: ignore[attr-defined]
                    loss = model(batch).sum()
            loss.backward()

        return run

    timings = interleaved(
        {
            "plain autograd": step(None),
            "torch saved_tensors_hooks": step(
                lambda: torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ),
            "tensorhooks saved_tensors_hooks": step(
                lambda: tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)
            ),
        },
        rounds=rounds,
    )
    print_table(
        "Identity saved_tensors_hooks, fwd+bwd of 50 x Linear(64, 64), batch 8",
        timings,
        "torch saved_tensors_hooks",
    )
    ratio = timings.ratio("tensorhooks saved_tensors_hooks", "torch saved_tensors_hooks")
    check_target("identity hooks, tensorhooks / torch", ratio, at_most=1.10)
    return timings


def identity_hooks_transformer(rounds: int) -> Timings:
    config = LlamaConfig()
    model = TinyLlama(config)
    tokens = make_tokens(config)

    def identity(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def step(hooks: Callable[[], Any] | None) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            if hooks is None:
                loss = model(tokens)
            else:
                with hooks():
                    loss = model(tokens)
            loss.backward()  # type: ignore[no-untyped-call]

        return run

    timings = interleaved(
        {
            "plain autograd": step(None),
            "torch saved_tensors_hooks": step(
                lambda: torch_graph.saved_tensors_hooks(identity, identity)
            ),
            "tensorhooks saved_tensors_hooks": step(
                lambda: tensorhooks.saved_tensors_hooks(identity, identity)
            ),
        },
        rounds=rounds,
    )
    print_table(
        f"Identity saved_tensors_hooks, fwd+bwd of {TRANSFORMER}",
        timings,
        "torch saved_tensors_hooks",
    )
    ratio = timings.ratio("tensorhooks saved_tensors_hooks", "torch saved_tensors_hooks")
    print(f"tensorhooks / torch per round: {ratio.format(digits=3)}")
    check_target("identity hooks on the transformer, tensorhooks / torch", ratio, at_most=1.10)
    return timings


def multi_grad_hooks(rounds: int) -> Timings:
    # One identical model per variant, hooks registered once (as in real use), steps interleaved.
    fired = [0]

    def on_bucket(grads: object) -> None:
        fired[0] += 1

    batch = torch.randn(8, 64)
    variants: dict[str, Callable[[], None]] = {}
    for name, register in (
        ("no hooks", None),
        ("torch register_multi_grad_hook", torch_graph.register_multi_grad_hook),
        ("tensorhooks register_multi_grad_hook", tensorhooks.register_multi_grad_hook),
    ):
        model = mlp(200)  # 200 weights + 200 biases = 400 parameters
        params = list(model.parameters())
        buckets = [params[i : i + 8] for i in range(0, len(params), 8)]
        assert len(params) == 400
        assert len(buckets) == 50
        if register is not None:
            for bucket in buckets:
                register(bucket, on_bucket)
        variants[name] = lambda model=model: model(batch).sum().backward()

    timings = interleaved(variants, rounds=rounds, inner=5)
    medians = {name: timings.median(name) for name in variants}
    print_table(
        "Multi-grad hooks, mode='all', 400 parameters in 50 buckets, "
        "fwd+bwd of 200 x Linear(64, 64), batch 8",
        timings,
        "torch register_multi_grad_hook",
    )
    base = medians["no hooks"]
    torch_cost = medians["torch register_multi_grad_hook"] - base
    ours_cost = medians["tensorhooks register_multi_grad_hook"] - base
    print(
        f"hook cost over no hooks: torch {torch_cost * 1e3:.3f} ms, tensorhooks "
        f"{ours_cost * 1e3:.3f} ms per step"
    )
    ratio = timings.ratio("tensorhooks register_multi_grad_hook", "torch register_multi_grad_hook")
    check_target("multi-grad hooks step, tensorhooks / torch", ratio, at_most=1.10)
    return timings


def multi_grad_registration(rounds: int) -> dict[str, Timings]:
    """Registering and removing one multi-grad hook per bucket, as a reducer does per model."""

    def on_bucket(grads: object) -> None:
        pass

    model = mlp(200)  # 200 weights + 200 biases = 400 parameters
    params = list(model.parameters())
    buckets = [params[i : i + 8] for i in range(0, len(params), 8)]
    assert len(params) == 400
    assert len(buckets) == 50

    def cycle(register: Callable[..., Any], mode: str) -> Callable[[], None]:
        def run() -> None:
            handles = [register(bucket, on_bucket, mode=mode) for bucket in buckets]
            for handle in handles:
                handle.remove()

        return run

    results: dict[str, Timings] = {}
    for mode in ("all", "any"):
        # Both variants hook the same parameters, each removing its hooks before the other runs.
        timings = interleaved(
            {
                "torch register_multi_grad_hook": cycle(torch_graph.register_multi_grad_hook, mode),
                "tensorhooks register_multi_grad_hook": cycle(
                    tensorhooks.register_multi_grad_hook, mode
                ),
            },
            rounds=rounds,
            inner=20,
        )
        print_table(
            f"Multi-grad hooks, mode={mode!r}: registering and removing 50 hooks, one per bucket "
            "of 8 of 400 parameters",
            timings,
            "torch register_multi_grad_hook",
        )
        ratio = timings.ratio(
            "tensorhooks register_multi_grad_hook", "torch register_multi_grad_hook"
        )
        check_target(
            f"multi-grad hooks registration and removal (mode {mode!r}), tensorhooks / torch",
            ratio,
            at_most=1.10,
        )
        results[mode] = timings
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--only",
        choices=("mlp", "transformer", "multigrad", "registration"),
        help="run one benchmark only",
    )
    args = parser.parse_args()
    if args.only in (None, "mlp"):
        identity_hooks(args.rounds)
    if args.only in (None, "transformer"):
        identity_hooks_transformer(args.rounds)
    if args.only in (None, "multigrad"):
        multi_grad_hooks(args.rounds)
    if args.only in (None, "registration"):
        multi_grad_registration(args.rounds)


if __name__ == "__main__":
    main()
