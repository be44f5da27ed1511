"""Step time of tensorhooks.distributed.sync_gradients against DistributedDataParallel.

Two gloo processes on this machine train the same MLP (forward + backward + ``p.grad = None``
per step), once wrapped in DDP and once with sync_gradients, interleaved round by round in one
run by the one harness (``tensorhooks.cli._bench.sync``, which ``python -m tensorhooks bench``
runs too); rank 0's medians with their range and per-round ratios are printed. A third variant,
the same step without any synchronisation, shows how much of the step is communication.

Run: python benchmarks/sync_gradients.py [--rounds 30] [--width 1024] [--layers 6]
"""

from __future__ import annotations

import argparse

from tensorhooks.cli._bench.sync import SyncConfig, run_two_processes
from tensorhooks.cli._harness import check_target, print_table


def main() -> None:
    defaults = SyncConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--inner", type=int, default=defaults.inner)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--bucket-cap-mb", type=float, default=defaults.bucket_cap_mb)
    config = SyncConfig(**vars(parser.parse_args()))
    result = run_two_processes(config)
    print(result.describe(config))
    print_table("step time, rank 0", result.timings, "DDP")
    # Each round times both variants a few milliseconds apart, so the ratio within a round is
    # less exposed to load drifting on a shared machine than the ratio of medians.
    ratio = result.timings.ratio("sync_gradients", "DDP")
    check_target("sync_gradients / DDP step", ratio, at_most=1.10)


if __name__ == "__main__":
    main()
