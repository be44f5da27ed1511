"""Which arguments an operator writes, read from its schema, and the read-only fast path."""

from __future__ import annotations

import pytest
import torch

import tensorhooks
from tensorhooks._mutation import op_writes

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def test_written_arguments_read_from_the_schema() -> None:
    """In-place self, out= (resizable), foreach lists, multi-output out, resize_."""
    aten = torch.ops.aten
    written = op_writes.written_arguments
    assert written(aten.add.Tensor) == ()
    assert written(aten.add_.Tensor) == ((0, "self", False),)
    assert written(aten.add.out) == ((-1, "out", True),)
    assert written(aten._foreach_mul_.Scalar) == ((0, "self", False),)
    assert written(aten.max.dim_max) == ((-1, "max", True), (-1, "max_values", True))
    assert written(aten.resize_.default) == ((0, "self", True),)
    # Its schema says it writes self; it only tells the allocator which stream uses it.
    assert written(aten.record_stream.default) == ()


def test_read_only_ops_take_the_fast_path() -> None:
    """After its first call an op that writes nothing is a single dict lookup."""
    with tensorhooks.allow_mutation_on_saved_tensors():
        torch.randn(3).cos().mul_(2.0)
    assert op_writes.READ_ONLY_OPS[id(torch.ops.aten.cos.default)] is (
        torch.ops.aten.cos.default._op
    )
    assert id(torch.ops.aten.mul_.Tensor) not in op_writes.READ_ONLY_OPS
    writing = op_writes.WRITING_OPS[id(torch.ops.aten.mul_.Tensor)]
    assert writing.written == ((0, "self", False),)
