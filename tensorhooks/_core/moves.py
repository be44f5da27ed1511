"""Data swapped for an equal copy (``tensor.data = copy``), told to the checks that watch storages.

A check that a tensor still has the storage it had (``param.data = ...`` replaces the values and
moves no version) must not refuse a feature that streams a tensor's data between copies of the
same values (`offload_parameters` installs a device copy for a block, and the host copy after).
Such a feature counts each swap on the tensor; a storage that changed with no swap counted is a
replacement by someone else.
"""

from __future__ import annotations

import torch

__all__ = ["moves", "note_moved"]

_ATTRIBUTE = "_tensorhooks_moves"


def note_moved(tensor: torch.Tensor) -> None:
    """Count a swap of ``tensor``'s data for a copy holding the same values."""
    tensor.__dict__[_ATTRIBUTE] = moves(tensor) + 1


def moves(tensor: torch.Tensor) -> int:
    """How many swaps of ``tensor``'s data for an equal copy were counted.

    Read from the tensor's ``__dict__``: checkpoint asks it of every tensor it watches, every
    call, and a missing attribute looked up with ``getattr`` costs an exception.
    """
    count: int = tensor.__dict__.get(_ATTRIBUTE, 0)
    return count
