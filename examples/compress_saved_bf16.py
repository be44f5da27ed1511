"""A custom pack/unpack pair: keep saved activations in bfloat16, half the memory of float32.

tensorhooks.saved_tensors_hooks calls pack for every tensor the forward pass saves for backward
and unpack when backward needs it. Here pack stores float32 activations as bfloat16 (parameters
are left alone: they are alive anyway, a copy would only add memory) and unpack turns them back
into float32. The gradients are approximate, close enough to train with: the script measures the
memory saved, how far the gradients move, and trains both ways side by side.

    python examples/compress_saved_bf16.py
"""

from __future__ import annotations

import torch
from torch import nn

import tensorhooks


class CompressToBf16(tensorhooks.saved_tensors_hooks):
    """Store float32 activations saved for backward as bfloat16; count the bytes."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.keep = {p.data_ptr() for p in parameters}
        self.original_bytes = 0
        self.stored_bytes = 0
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.original_bytes += tensor.nbytes
        if tensor.dtype != torch.float32 or tensor.data_ptr() in self.keep:
            self.stored_bytes += tensor.nbytes
            return tensor
        packed = tensor.to(torch.bfloat16)
        self.stored_bytes += packed.nbytes
        return packed

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        return packed.to(torch.float32) if packed.dtype == torch.bfloat16 else packed


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 256)]
    for _ in range(4):
        layers += [nn.GELU(), nn.Linear(256, 256)]
    layers += [nn.GELU(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def main() -> None:
    # A learnable task: the labels of a random linear teacher.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=generator)
    target = (x @ torch.randn(64, 10, generator=generator)).argmax(dim=1)

    plain, compressed = make_model(), make_model()
    hooks = CompressToBf16(list(compressed.parameters()))

    nn.functional.cross_entropy(plain(x), target).backward()
    with hooks:
        loss = nn.functional.cross_entropy(compressed(x), target)
    loss.backward()
    print(
        f"saved for backward: {hooks.original_bytes / 2**20:.2f} MiB as float32, "
        f"{hooks.stored_bytes / 2**20:.2f} MiB stored with bf16 activations"
    )
    assert hooks.stored_bytes < 0.7 * hooks.original_bytes

    flat = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (plain, compressed)]
    cosine = torch.nn.functional.cosine_similarity(flat[0], flat[1], dim=0).item()
    relative = ((flat[0] - flat[1]).norm() / flat[0].norm()).item()
    print(f"gradient vs float32: cosine similarity {cosine:.5f}, relative error {relative:.2e}")
    assert cosine > 0.999

    optimizers = [torch.optim.Adam(m.parameters(), lr=3e-3) for m in (plain, compressed)]
    for step in range(20):
        losses = []
        for model, optimizer, compress in zip(
            (plain, compressed), optimizers, (False, True), strict=True
        ):
            optimizer.zero_grad()
            if compress:
                with hooks:
                    loss = nn.functional.cross_entropy(model(x), target)
            else:
                loss = nn.functional.cross_entropy(model(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if step % 5 == 0 or step == 19:
            print(f"step {step:2d}: loss {losses[0]:.4f} float32, {losses[1]:.4f} bf16 saved")
    assert abs(losses[0] - losses[1]) < 0.05 * losses[0]


if __name__ == "__main__":
    main()
