"""Offload a model's activations to host memory with tensorhooks.save_on_cpu.

Every tensor the forward pass saves for backward is kept in (pinned) host memory instead of on
the GPU, and copied back when backward needs it: peak GPU memory drops by the size of the
activations, and the gradients are exactly those of plain autograd. On a machine without a GPU
the script still runs (tensors already live in host memory, so nothing moves) and checks the
gradients.

    python examples/offload_activations.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

import tensorhooks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH, DEPTH, BATCH = (1024, 16, 512) if DEVICE == "cuda" else (256, 8, 64)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def train_step(model: nn.Module, x: torch.Tensor, offload: bool) -> tuple[float, int]:
    """One forward + backward; returns the loss and the peak memory the step added (CUDA)."""
    model.zero_grad(set_to_none=False)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    if offload:
        with tensorhooks.save_on_cpu(pin_memory=DEVICE == "cuda"):
            loss = model(x).square().mean()
            loss.backward()
    else:
        loss = model(x).square().mean()
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - before if DEVICE == "cuda" else 0
    return loss.item(), peak


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(WIDTH) for _ in range(DEPTH)]).to(DEVICE)
    x = torch.randn(BATCH, WIDTH, device=DEVICE)

    # Gradients under offloading are those of plain autograd.
    train_step(model, x, offload=False)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    _, plain_peak = train_step(model, x, offload=False)
    _, offload_peak = train_step(model, x, offload=True)
    for p, expected in zip(model.parameters(), plain_grads, strict=True):
        assert torch.allclose(p.grad, expected, rtol=1e-5, atol=1e-6), "gradients differ"
    print(f"{DEVICE}: gradients under save_on_cpu match plain autograd")
    if DEVICE == "cuda":
        saved = 1 - offload_peak / plain_peak
        print(
            f"peak memory of a step: {plain_peak / 2**20:.0f} MiB plain, "
            f"{offload_peak / 2**20:.0f} MiB with activations offloaded ({saved:.0%} less)"
        )

    # A few training steps under save_on_cpu: on a GPU the activations go to host memory; on a
    # CPU they are already there, so nothing is copied and the steps only show it runs.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    for step in range(5):
        loss, _ = train_step(model, x, offload=True)
        optimizer.step()
        print(f"step {step}: loss {loss:.4f}")
    seconds = time.perf_counter() - started
    if DEVICE == "cuda":
        print(f"5 steps with activations offloaded to host memory in {seconds:.2f}s")
    else:
        print(f"5 steps under save_on_cpu in {seconds:.2f}s; nothing was offloaded:")
        print("on a CPU the activations already live in host memory (a GPU moves them)")


if __name__ == "__main__":
    main()
