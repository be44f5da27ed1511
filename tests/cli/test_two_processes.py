"""Two local gloo processes: rank 0's result comes back, and both processes leave the group."""

from __future__ import annotations

import pytest
import torch

from tensorhooks.cli._two_processes import WORLD_SIZE, run_on_two_processes


def _sum_of_ranks(rank: int, scale: float) -> tuple[int, float]:
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, scale * float(total)


@pytest.mark.slow
def test_rank_zeros_result_comes_back() -> None:
    """The worker runs in both processes of one group; rank 0's return value is the result."""
    assert WORLD_SIZE == 2
    assert run_on_two_processes(_sum_of_ranks, 10.0) == (0, 10.0)
