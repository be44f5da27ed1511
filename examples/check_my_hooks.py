"""Check a pair of saved-tensor hooks on random autograd programs with tensorhooks.testing.

Run: python examples/check_my_hooks.py   (needs `pip install tensorhooks[testing]`)

The programs are drawn by hypothesis under a derandomized profile: every run draws the same
ones and gives the same answer.
"""

from __future__ import annotations

import torch
from hypothesis import settings

from tensorhooks import saved_tensors_hooks
from tensorhooks.testing import (
    GradientMismatchError,
    assert_hooks_preserve_gradients,
    check_module,
)

settings.register_profile("example", derandomize=True, database=None, deadline=None)


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
    settings.load_profile("example")  # the same programs on every run
    # bfloat16 rounds every saved value: the tolerance is what that rounding can change in each
    # program, measured on the program, so it scales with the values (a fixed rtol/atol does
    # not: gradients of random programs reach the hundreds).
    assert_hooks_preserve_gradients(
        pack_bf16, unpack_bf16, precision=torch.bfloat16, max_examples=30
    )
    print("bfloat16 pair: gradients preserved on 30 random programs")

    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    batch = torch.randn(4, 10, 32)
    check_module(
        model,
        batch,
        lambda: saved_tensors_hooks(pack_bf16, unpack_bf16),
        precision=torch.bfloat16,
    )
    print("bfloat16 pair: a TransformerEncoderLayer's gradients preserved")

    # The point of the checker: catch a pair that gets gradients wrong, with a program to rerun.
    try:
        assert_hooks_preserve_gradients(pack_raw, unpack_raw, max_examples=200)
    except GradientMismatchError as error:
        report, _, program = str(error).partition("The program, as Python")
        print("\nraw-buffer pair: caught giving a wrong gradient, as it should be.")
        print("What the check reports (plain autograd: the expected gradient; the context:")
        print("the gradient under the pair):\n")
        print(report.strip())
        print(f"\nThe shrunk program, as Python{program.rstrip()}\n")
        print(
            "That is what the checker is for: the raw-buffer pair trains without an error, on\n"
            "wrong gradients. The bfloat16 pair passed the same check above."
        )
    else:
        raise SystemExit("the raw-buffer pair should have failed")


if __name__ == "__main__":
    main()
