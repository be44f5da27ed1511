"""Hypothesis strategies shared by the test modules: random autograd programs and hook sets."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

# --- save_on_cpu -------------------------------------------------------------------------------

# Ops of the random programs run under save_on_cpu: every value is a square matrix, so any two
# values combine. Unary ops save their input or result; binary ops save one or both operands;
# "t" saves nothing but makes later saves of a transposed (dense, non-contiguous) view; "slice"
# saves a strided, non-dense view; "mul_" changes a value in place after it may have been saved.
OFFLOAD_UNARY_OPS = ("sin", "tanh", "sigmoid", "relu", "square", "exp", "t", "slice")
OFFLOAD_BINARY_OPS = ("mul", "add", "matmul")
OFFLOAD_INPLACE_OPS = ("mul_",)


class OffloadProgram(NamedTuple):
    """A random autograd program: ``ops`` over ``n``x``n`` values seeded by ``seed``.

    Values 0 and 1 are leaves (an input that requires grad and an ``nn.Parameter``); op ``k``
    appends value ``k + 2``. Each op is ``(name, i, j)`` with ``i, j`` indices of earlier values
    (``j`` unused by unary ops). The loss is the sum of the values in ``outputs``.
    """

    n: int
    seed: int
    ops: tuple[tuple[str, int, int], ...]
    outputs: tuple[int, ...]


@st.composite
def offload_programs(draw: st.DrawFn, *, inplace: bool = False) -> OffloadProgram:
    """Random programs for save_on_cpu; with ``inplace``, some ops change values in place."""
    # In-place ops are drawn often enough that some change a value already saved.
    names = OFFLOAD_UNARY_OPS + OFFLOAD_BINARY_OPS + (OFFLOAD_INPLACE_OPS * 4 if inplace else ())
    length = draw(st.integers(1, 8))
    ops = []
    for k in range(length):
        values = k + 2
        name = draw(st.sampled_from(names))
        # Leaves (0 and 1) cannot be changed in place: aim in-place ops at computed values.
        low = 2 if name in OFFLOAD_INPLACE_OPS and values > 2 else 0
        ops.append((name, draw(st.integers(low, values - 1)), draw(st.integers(0, values - 1))))
    total = length + 2
    outputs = draw(st.lists(st.integers(2, total - 1), min_size=1, max_size=3, unique=True))
    return OffloadProgram(
        n=draw(st.integers(2, 5)),
        seed=draw(st.integers(0, 2**16)),
        ops=tuple(ops),
        outputs=tuple(outputs),
    )


def offload_options() -> st.SearchStrategy[dict[str, object]]:
    """Keyword options of save_on_cpu, small thresholds so that test tensors get copied."""
    return st.fixed_dictionaries(
        {
            "pin_memory": st.booleans(),
            "min_offload_bytes": st.sampled_from([0, 16, 40, 1 << 20]),
            "offload_parameters": st.booleans(),
            "prefetch": st.integers(0, 3),
            "max_in_flight": st.integers(0, 5),
        }
    )
