"""Which arguments an operator writes, read once from its schema and cached per operator.

The dispatch mode (`dispatch_mode`) calls an operator that writes nothing straight through
`READ_ONLY_OPS`, and protects what one that writes reaches first. See
NOTE [Clone before write] in `context.py`, "Costs".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from tensorhooks._core.torch_compat import OpOverload, op_schema

__all__ = [
    "READ_ONLY_OPS",
    "SEEN_OPS",
    "WRITING_OPS",
    "WritingOp",
    "tensors_in",
    "written_arguments",
    "written_values",
]

# Ops whose schema marks a write that changes no value: ``record_stream`` only tells the caching
# allocator which stream uses the memory (save_on_cpu calls it on every tensor it copies back).
_VALUE_PRESERVING_OPS = frozenset({"aten::record_stream"})
# Ops that write back values their caller freed: FSDP2's all-gather copy-out refills the unsharded
# parameters whose storage FSDP2 resized to zero bytes after forward (no operator sees that), so
# the bytes a clone would copy before it are freed memory, and after it the saved weights read
# their save-time values again. See NOTE [Writes autograd does not count] in `saved_tensor.py`.
_RESTORING_OPS = frozenset({"fsdp::split_with_sizes_copy"})
# Ops that may resize the tensor they write (besides every ``out=`` argument).
_RESIZING_OPS = frozenset(
    {"aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_", "aten::set_"}
)


class _WrittenArgument(NamedTuple):
    position: int  # index into args, or -1 for keyword-only arguments
    name: str
    resizes: bool


class WritingOp(NamedTuple):
    call: Callable[..., Any]
    written: tuple[_WrittenArgument, ...]


# Both keyed by id(OpOverload): OpOverload.__hash__ is Python code. Every op seen is kept alive in
# SEEN_OPS, so an id can never be reused by another op.
# Ops that write nothing -> what to call: the per-operator fast path.
READ_ONLY_OPS: dict[int, Callable[..., Any]] = {}
# Ops that write -> what to call and which arguments they write.
WRITING_OPS: dict[int, WritingOp] = {}
SEEN_OPS: list[OpOverload] = []


def written_arguments(func: OpOverload) -> tuple[_WrittenArgument, ...]:
    """The arguments ``func`` writes, read once from its schema."""
    schema = op_schema(func)
    if schema.name in _VALUE_PRESERVING_OPS or schema.name in _RESTORING_OPS:
        return ()
    resizing_op = schema.name in _RESIZING_OPS
    written = []
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        written.append(
            _WrittenArgument(
                -1 if argument.kwarg_only else position,
                argument.name,
                argument.is_out or resizing_op,
            )
        )
    return tuple(written)


def written_values(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors that ``func`` called with ``args`` and ``kwargs`` writes."""
    op = WRITING_OPS.get(id(func))
    written = op.written if op is not None else written_arguments(func)
    values = []
    for argument in written:
        position = argument.position
        values.append(args[position] if 0 <= position < len(args) else kwargs.get(argument.name))
    return tensors_in(values)


def tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values``, and those in the lists and tuples among them."""
    tensors: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(item for item in value if isinstance(item, torch.Tensor))
    return tensors
