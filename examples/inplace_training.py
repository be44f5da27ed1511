"""Train code that changes saved tensors in place, under allow_mutation_on_saved_tensors.

The model below is written the way memory-conscious code often is: residual adds and the
activation run in place. Plain autograd refuses its backward (the layer norm saved the tensor
that the residual add then overwrote). Under tensorhooks.allow_mutation_on_saved_tensors() the
saved tensors keep their save-time values, and the gradients are exactly those of the same model
written out of place.

    python examples/inplace_training.py
"""

from __future__ import annotations

import torch
from torch import nn

import tensorhooks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        hidden = self.up(self.norm(x))  # the layer norm saves x for backward
        hidden = hidden.relu_() if inplace else hidden.relu()
        update = self.down(hidden)
        return x.add_(update) if inplace else x + update  # in place: overwrites the saved x


class Model(nn.Module):
    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, inplace)
        return self.head(h).squeeze(-1)


def gradients(model: Model, x: torch.Tensor, y: torch.Tensor, inplace: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x, inplace), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(256, 16)
    y = torch.tanh(x @ torch.randn(16))  # a learnable target

    try:
        gradients(model, x, y, inplace=True)
    except RuntimeError as error:
        print(f"plain autograd refuses the in-place model: {str(error).splitlines()[0][:90]}...")
    else:
        raise AssertionError("plain autograd should refuse the in-place model")

    expected = gradients(model, x, y, inplace=False)
    with tensorhooks.allow_mutation_on_saved_tensors():
        got = gradients(model, x, y, inplace=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), "in-place gradients differ from the out-of-place model's"
    print("under allow_mutation_on_saved_tensors: gradients identical to the out-of-place model")

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    for step in range(10):
        optimizer.zero_grad()
        with tensorhooks.allow_mutation_on_saved_tensors():
            loss = torch.nn.functional.mse_loss(model(x, inplace=True), y)
            loss.backward()
        optimizer.step()
        if step % 3 == 0 or step == 9:
            print(f"step {step:2d}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
