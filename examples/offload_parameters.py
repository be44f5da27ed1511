"""Train a model whose parameters live in host memory with tensorhooks.offload_parameters.

Each block of the model visits the GPU only while it runs (forward and backward); parameters,
gradients and AdamW's state stay in pinned host memory. The script trains the same stack once
resident and once offloaded, checks that both end with the same weights, and on a GPU prints the
peak device memory of each. Without a GPU the same code runs on the CPU, where
offload_parameters(device="cpu") streams nothing (so CI runs the script unchanged).

    python examples/offload_parameters.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import tensorhooks

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
WIDTH, DEPTH, BATCH, STEPS = (2048, 12, 256, 4) if CUDA else (64, 6, 16, 4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def train(model: nn.Module) -> float:
    """Train ``STEPS`` AdamW steps; return the peak device memory in MiB (0 on the CPU)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=generator).to(DEVICE)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cuda.max_memory_allocated() / 2**20 if CUDA else 0.0


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(DEPTH)))

    resident = copy.deepcopy(model).to(DEVICE)
    resident_peak = train(resident)
    expected = {name: value.cpu() for name, value in resident.state_dict().items()}
    del resident
    if CUDA:
        torch.cuda.empty_cache()

    handle = tensorhooks.offload_parameters(model, device=DEVICE, prefetch=1)
    print(handle)  # which blocks move together: by default the model's children
    offloaded_peak = train(model)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)
    handle.remove()

    print(f"blocks: {DEPTH}, parameters: {sum(p.numel() for p in model.parameters()):,}")
    print("weights after training: offloaded == resident")
    if CUDA:
        print(f"peak device memory: resident {resident_peak:.0f} MiB, ", end="")
        print(f"offloaded {offloaded_peak:.0f} MiB")
    else:
        print("no GPU: ran on the CPU, nothing streamed")


if __name__ == "__main__":
    main()
