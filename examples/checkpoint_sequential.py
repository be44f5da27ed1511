"""Checkpoint a deep nn.Sequential in segments: one import line changed from torch's code.

`checkpoint_sequential` cuts the model into segments and keeps only each segment's input for
backward; backward recomputes one segment at a time. The script counts the bytes the forward pass
keeps for backward with and without it, checks that the gradients are plain autograd's, and
takes them with `torch.autograd.grad` (which torch's default reentrant variant refuses). The same
model's layers are then checkpointed one by one with `checkpoint_module`, the counterpart of
torch's composable `checkpoint(module)`, with a forward pre-hook that runs again in
recomputation.

    python examples/checkpoint_sequential.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import tensorhooks
import tensorhooks.checkpointing as checkpoint_utils  # was: import torch.utils.checkpoint


def kept_bytes(step: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors the forward pass saves for backward (parameters left out)."""
    kept = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        if not isinstance(tensor, nn.Parameter):
            kept += tensor.nbytes
        return tensor

    with tensorhooks.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    return kept, out


def main() -> None:
    torch.manual_seed(0)
    depth, width = 16, 256
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
    )
    x = torch.randn(64, width, requires_grad=True)
    inputs = [x, *model.parameters()]

    plain_bytes, out = kept_bytes(lambda: model(x))
    expected = torch.autograd.grad(out.square().mean(), inputs)
    print(f"plain autograd keeps {plain_bytes / 2**20:.1f} MiB for backward")

    kept = [plain_bytes]
    for segments in (2, 4, 8):
        ours_bytes, out = kept_bytes(
            lambda segments=segments: checkpoint_utils.checkpoint_sequential(
                model, segments, x, use_reentrant=False
            )
        )
        got = torch.autograd.grad(out.square().mean(), inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert ours_bytes < kept[-1]  # more segments, less kept: the last one runs as is
        kept.append(ours_bytes)
        print(
            f"checkpoint_sequential, {segments} segments: keeps {ours_bytes / 2**20:.1f} MiB, "
            "same gradients"
        )

    assert kept[-1] < plain_bytes / 4

    calls = []
    for layer in model:
        checkpoint_utils.checkpoint_module(layer)  # was: torch.distributed._composable.checkpoint
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    module_bytes, out = kept_bytes(lambda: model(x))
    got = torch.autograd.grad(out.square().mean(), inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert module_bytes < plain_bytes / 4
    assert len(calls) == 2 * depth  # each layer's pre-hook: in forward, then in recomputation
    print(
        f"checkpoint_module on each layer: keeps {module_bytes / 2**20:.1f} MiB, same gradients; "
        f"the layers' forward pre-hooks ran {len(calls)} times for {depth} layers "
        "(again in recomputation)"
    )
    assert tensorhooks.live_graph_tasks() == 0


if __name__ == "__main__":
    main()
