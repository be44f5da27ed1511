"""Recomputation that reads (and writes) stand-in storages in place of some real tensors.

See NOTE [Stand-ins for state a region wrote].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorhooks._core.torch_compat import (
    UnwrappedDispatchMode,
    below_python_modes,
    op_schema,
    returns_alias,
    set_version_counters,
    storage_key,
)

__all__ = ["Substitution"]

# NOTE [Stand-ins for state a region wrote]
#
# A region that writes state in place in its forward pass (a running statistic, a counter, the
# power iteration of spectral norm) read that state before writing it. Recomputation must read
# it as the forward pass did, and must not write the real state a second time. A *substitution*
# maps the storage of each such tensor to a stand-in holding the value the forward pass read (a
# copy taken before the write, or the value ``allow_mutation_on_saved_tensors`` kept). A
# dispatch mode around recomputation reads every op's tensor arguments that live on a
# substituted storage from the stand-in; writes go to the stand-in too, so the real tensor is
# left as the forward pass left it. View ops pass through, so autograd's view tracking and the
# gradient's path to the real tensor are untouched. The tensors recomputation saves are taken
# from the stand-ins as well (a copy: recomputation may write the stand-in after saving it).
#
# The mode holds the substitution through an attribute, never through a closure that refers to
# itself: such a cycle would keep every stand-in alive until the collector runs. The
# substitution holds the real storages while it lives: a stand-in is found by its storage's
# address, which the allocator could give to a tensor recomputation makes once the function
# released the real one (``param.data = gathered.clone()`` in the function).
#
# State written with no copy of its value before the write (NOTE [State a region reaches]) gets a
# stand-in holding the value the write left. Writing it again is harmless (the real tensor is
# left as the forward pass left it); reading it is not: read before recomputation's own write, it
# holds another value than the forward pass read, and read after a write that does not give the
# same value again (a counter, as opposed to a renormalisation) too. The mode notes, for these
# stand-ins only, each read by an op that does not write it, and whether a write came before.


def _over(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype and geometry on ``storage``."""
    tensor = torch.empty(0, dtype=like.dtype, device=like.device)
    return tensor.set_(storage, like.storage_offset(), like.size(), like.stride())


def _copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    copy: torch.UntypedStorage = storage.clone()  # type: ignore[no-untyped-call]  # untyped in torch
    return copy


class Substitution:
    """Stand-in storages holding what the forward pass read, for the storages of some tensors."""

    __slots__ = ("reads", "real", "storages", "tensors", "versions")

    def __init__(
        self,
        values: Sequence[tuple[torch.Tensor, torch.Tensor]],
        watched: Sequence[torch.Tensor] = (),
    ) -> None:
        self.storages: dict[int | None, torch.UntypedStorage] = {}
        # For each watched storage (state written with no copy): [written yet, read before a
        # write, read after one].
        self.reads: dict[int | None, list[bool]] = {
            storage_key(tensor): [False, False, False] for tensor in watched
        }
        self.tensors = tuple(tensor for tensor, _ in values)
        self.versions = tuple(tensor._version for tensor in self.tensors)
        # Held while the substitution lives (NOTE [Stand-ins for state a region wrote]).
        self.real = [tensor.untyped_storage() for tensor in self.tensors]
        with below_python_modes(), torch.no_grad():
            for tensor, value in values:
                key = storage_key(tensor)
                storage = self.storages.get(key)
                if storage is None:
                    storage = self.storages[key] = _copy(tensor.untyped_storage())
                _over(storage, tensor).copy_(value)

    def swap(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read from its stand-in if its storage has one."""
        storage = self.storages.get(storage_key(tensor))
        if storage is None:
            return tensor
        with below_python_modes():
            return _over(storage, tensor)

    def saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """What recomputation keeps of a saved ``tensor``: a copy of its stand-in's value."""
        swapped = self.swap(tensor)
        if swapped is tensor:
            return tensor
        with below_python_modes():
            return swapped.clone()

    def reproduced(self, tensor: torch.Tensor) -> bool:
        """Whether recomputation read what the forward pass read of a watched ``tensor``.

        For state the forward pass wrote with no copy of its value before the write: the
        stand-in started from the value after it. Never read otherwise than by its own writes,
        or read only after a write that gave its value again (a renormalisation, a cache filled
        again), it read what the forward pass read.
        """
        _, before, after = self.reads[storage_key(tensor)]
        if before:
            return False
        if not after:
            return True
        with below_python_modes():
            return bool(torch.equal(self.swap(tensor), tensor))

    def note(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Note the watched storages ``func`` reads without writing them, and those it writes."""
        reads = self.reads
        arguments = op_schema(func).arguments
        for position, argument in enumerate(arguments):
            value = kwargs.get(argument.name) if position >= len(args) else args[position]
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(tensor, torch.Tensor):
                    continue
                state = reads.get(storage_key(tensor))
                if state is None:
                    continue
                info = argument.alias_info
                if info is not None and info.is_write:
                    state[0] = True
                else:
                    state[1 if not state[0] else 2] = True

    def restore_versions(self) -> None:
        """Undo the version moves of the real tensors: the recomputation wrote the stand-ins.

        Autograd moves the version counter of a tensor an in-place op names, although the write
        went to its stand-in; left moved, it would make a later unpack of the unchanged tensor
        raise autograd's in-place error.
        """
        set_version_counters(self.tensors, self.versions)

    def mode(self) -> _Substitute:
        """The dispatch mode that makes recomputation's ops read the stand-ins."""
        return _Substitute(self)


class _Substitute(UnwrappedDispatchMode):
    """Reads (and writes) substituted storages from their stand-ins; views pass through."""

    def __init__(self, substitution: Substitution) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.substitution = substitution

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        aliased, writes = returns_alias(func)
        if aliased and not writes:  # a view: keep autograd's view of the real tensor
            return func(*args, **kwargs)
        if self.substitution.reads:
            self.substitution.note(func, args, kwargs)
        originals: dict[int, torch.Tensor] = {}
        result = func(
            *self._swap(tuple(args), originals),
            **{key: self._swap(item, originals) for key, item in kwargs.items()},
        )
        if not writes or not originals:
            return result
        # An in-place or out= op returns the tensor it wrote: hand back the caller's object.
        if isinstance(result, torch.Tensor):
            return originals.get(id(result), result)
        if isinstance(result, (list, tuple)):
            return type(result)(originals.get(id(item), item) for item in result)
        return result

    def _swap(self, value: Any, originals: dict[int, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            swapped = self.substitution.swap(value)
            if swapped is not value:
                originals[id(swapped)] = value
            return swapped
        if isinstance(value, (list, tuple)):
            return type(value)(self._swap(item, originals) for item in value)
        return value
