"""Check a pair of saved-tensor hooks on random autograd programs with tensorhooks.testing.

Run: python examples/check_my_hooks.py   (needs `pip install tensorhooks[testing]`)
"""

from __future__ import annotations

import torch

from tensorhooks.testing import GradientMismatchError, assert_hooks_preserve_gradients


def pack_bf16(tensor: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
    """Keep saved tensors in bfloat16 (half the memory of float32)."""
    return tensor.dtype, tensor.detach().to(torch.bfloat16)


def unpack_bf16(packed: tuple[torch.dtype, torch.Tensor]) -> torch.Tensor:
    dtype, tensor = packed
    return tensor.to(dtype)


def pack_raw(tensor: torch.Tensor) -> tuple[torch.Size, torch.Tensor]:
    """A buggy pair: it copies memory in storage order and restores it as contiguous."""
    copy = tensor.detach().clone()
    return tensor.shape, copy.as_strided((copy.numel(),), (1,))


def unpack_raw(packed: tuple[torch.Size, torch.Tensor]) -> torch.Tensor:
    shape, flat = packed
    return flat.view(shape)


def main() -> None:
    # bfloat16 keeps 8 bits of mantissa: compare with a matching tolerance.
    assert_hooks_preserve_gradients(pack_bf16, unpack_bf16, rtol=0.1, atol=0.5, max_examples=30)
    print("bfloat16 pair: gradients preserved on 30 random programs")
    try:
        assert_hooks_preserve_gradients(pack_raw, unpack_raw, max_examples=200)
    except GradientMismatchError as error:
        print("raw-buffer pair: found a wrong gradient; shrunk program:\n")
        print(str(error).split("as Python", 1)[1])
    else:
        raise SystemExit("the raw-buffer pair should have failed")


if __name__ == "__main__":
    main()
