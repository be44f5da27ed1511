"""What autograd holds for backward, in bytes, while a step runs: the measured side of a plan.

See NOTE [Measuring what autograd holds] below.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tensorhooks._core.errors import PlanStateError
from tensorhooks._core.guards import is_output_of_saving_node, register_protected_pack_hook
from tensorhooks._core.torch_compat import (
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    storage_key,
    top_saved_tensors_hooks,
)
from tensorhooks._hooks import saved_tensors_hooks

__all__ = [
    "DEVICE",
    "HOST",
    "HeldBytes",
    "Hold",
    "delegating_hooks",
    "holding_hooks",
    "module_keys",
    "storage_bytes",
]

# NOTE [Measuring what autograd holds]
#
# The measured peak of a plan is the largest number of bytes that autograd holds for backward at
# any moment of the step: the distinct storages of the tensors saved for backward (a storage
# saved twice, or through two views, counts once), parameters and buffers of the model left out
# (the model holds them anyway). A storage counts from the save until autograd lets go of what
# the pack hook returned: after the node that saved it has run in backward, or when the graph is
# dropped. Each save gets a `Hold` inside what pack returns, so its lifetime is exactly that.
#
# Where the saves are seen. Outside checkpointed blocks a pair of hooks around the whole step
# sees them (`holding_hooks`); it also sees the inputs a `checkpoint` region saves. Inside a
# region the pack hook of `checkpoint` keeps nothing; there a pair pushed on top of it
# (`delegating_hooks`) hands every save on to it unchanged and notes its position. In backward
# the recomputation keeps the saved tensors of the region until their nodes unpack them: a
# second pair, pushed inside the recomputation, holds each from the moment it is kept, and the
# first pair's unpack lets it go. Outputs that a selective policy keeps are held from the policy
# call until the region's recomputation consumes them, which is when `checkpoint` lets them go;
# from then on they count as what the recomputation keeps, if it keeps them.
#
# Device or host. Offloaded tensors (by a policy or with a block's input) are held as host bytes,
# also on a machine without an accelerator, where `save_on_cpu` leaves CPU tensors in place. A
# recomputation that brings one back holds it as device bytes again, as a device would.
#
# Releases run from ``__del__`` on whatever thread drops a record, at any allocation (the cycle
# collector), so they only append to a deque; the counts are brought up to date under the lock
# before each new hold, which is the only moment the peak can grow.

DEVICE = 0
HOST = 1


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage (the whole storage, which a view keeps alive)."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # sparse and other layouts: their values
        return int(tensor.numel() * tensor.element_size())


class Hold:
    """One save's share of a storage; the storage stops counting when its last hold is dropped."""

    __slots__ = ("key", "owner", "where")

    def __init__(self, owner: HeldBytes, key: int, where: int) -> None:
        self.owner = owner
        self.key = key
        self.where = where

    def __del__(self) -> None:
        self.owner.released.append((self.key, self.where))


class HeldBytes:
    """The bytes held for backward now, on the device and on the host, and their peaks.

    Storages whose keys are in ``excluded`` are never counted: the model's parameters and
    buffers (``base``), and those of the block running now, whose data may have moved there
    (``offload_parameters`` installs device copies while a block runs; see `for_block`).
    """

    def __init__(self, base: Iterable[int]) -> None:
        self.base = frozenset(base)
        self.excluded: frozenset[int] = self.base
        self._counts: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._bytes = [0, 0]
        self.peak = [0, 0]
        self.released: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()

    def hold(self, tensor: torch.Tensor, where: int = DEVICE) -> Hold | None:
        """Count ``tensor``'s storage as held on ``where`` until the returned hold is dropped."""
        key = storage_key(tensor)
        if key is None or key in self.excluded:
            return None
        nbytes = storage_bytes(tensor)
        with self._lock:
            self._drain()
            counts = self._counts[where]
            entry = counts.get(key)
            if entry is None:
                counts[key] = [1, nbytes]
                self._bytes[where] += nbytes
                self.peak[where] = max(self.peak[where], self._bytes[where])
            else:
                entry[0] += 1
        return Hold(self, key, where)

    def for_block(self, module: torch.nn.Module) -> None:
        """Leave out the parameters and buffers of ``module`` as they are now, and the model's."""
        self.excluded = self.base | frozenset(module_keys(module))

    def now(self) -> tuple[int, int]:
        """The bytes held now: ``(device, host)``."""
        with self._lock:
            self._drain()
            return self._bytes[DEVICE], self._bytes[HOST]

    def _drain(self) -> None:
        released = self.released
        while released:
            key, where = released.popleft()
            entry = self._counts[where].get(key)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                del self._counts[where][key]
                self._bytes[where] -= entry[1]


def module_keys(module: torch.nn.Module) -> set[int]:
    """Storage keys of ``module``'s parameters and buffers (never counted as activations)."""
    keys = {storage_key(t) for t in (*module.parameters(), *module.buffers())}
    return {key for key in keys if key is not None}


def _unpack_first(packed: tuple[Any, Hold | None]) -> Any:
    return packed[0]


def holding_hooks(held: HeldBytes) -> saved_tensors_hooks:
    """A pair of hooks that keeps every saved tensor as it is and holds its storage on the device.

    Pushed through `saved_tensors_hooks`, so the save guard in force protects what it keeps.
    """

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, Hold | None]:
        # A detached alias of an output of the saving node: no cycle through its grad_fn.
        kept = tensor.detach() if is_output_of_saving_node(tensor) else tensor
        return kept, held.hold(tensor)

    return saved_tensors_hooks(pack, _unpack_first)


@contextlib.contextmanager
def delegating_hooks(
    on_pack: Callable[[torch.Tensor], Any],
    on_unpack: Callable[[Any], None] | None = None,
) -> Iterator[None]:
    """Push a pair that hands each save on to the innermost pair, noting it on the way.

    ``on_pack(tensor)`` runs before the innermost pair's pack and returns a note kept beside
    what that pack returned, for as long as autograd keeps it; ``on_unpack(note)`` runs after
    the innermost unpack. The pair changes nothing the innermost pair does, so it is declared
    protected like it (writes under it are as safe as under the pair it wraps).

    Raises:
        PlanStateError: if no saved-tensor hooks are in force to hand the saves on to.
    """
    top = top_saved_tensors_hooks()
    if top is None:
        raise PlanStateError(
            "plan_activations: no saved-tensor hooks in force inside a checkpointed block; the "
            "measurement needs checkpoint's own pair to wrap"
        )
    inner_pack, inner_unpack = top

    def pack(tensor: torch.Tensor) -> tuple[Any, Any]:
        note = on_pack(tensor)
        return inner_pack(tensor), note

    if on_unpack is None:

        def unpack(packed: tuple[Any, Any]) -> torch.Tensor:
            tensor: torch.Tensor = inner_unpack(packed[0])
            return tensor

    else:
        after = on_unpack

        def unpack(packed: tuple[Any, Any]) -> torch.Tensor:
            tensor: torch.Tensor = inner_unpack(packed[0])
            after(packed[1])
            return tensor

    register_protected_pack_hook(pack)
    push_saved_tensors_hooks(pack, unpack)
    try:
        yield
    finally:
        pop_saved_tensors_hooks()
