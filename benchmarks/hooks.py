"""Cost of identity saved-tensor hooks and of multi-grad hooks, tensorhooks against torch.

Run: python benchmarks/hooks.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.autograd.graph as torch_graph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved_medians, mlp, print_table

import tensorhooks


def identity_hooks(rounds: int) -> dict[str, float]:
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

    medians = interleaved_medians(
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
        medians,
        "torch saved_tensors_hooks",
    )
    return medians


def multi_grad_hooks(rounds: int) -> dict[str, float]:
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

    medians = interleaved_medians(variants, rounds=rounds, inner=5)
    print_table(
        "Multi-grad hooks, mode='all', 400 parameters in 50 buckets, "
        "fwd+bwd of 200 x Linear(64, 64), batch 8",
        medians,
        "torch register_multi_grad_hook",
    )
    base = medians["no hooks"]
    torch_cost = medians["torch register_multi_grad_hook"] - base
    ours_cost = medians["tensorhooks register_multi_grad_hook"] - base
    print(
        f"hook cost over no hooks: torch {torch_cost * 1e3:.3f} ms, tensorhooks "
        f"{ours_cost * 1e3:.3f} ms per step"
    )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    identity_hooks(args.rounds)
    multi_grad_hooks(args.rounds)


if __name__ == "__main__":
    main()
