"""What the benchmark scripts share, re-exported from the package: `tensorhooks.cli._harness`.

Kept so that scripts can write ``from harness import interleaved, mlp, print_table``;
the timing code and the models live in the package, once (see NOTE [How tensorhooks times
things] there).
"""

from __future__ import annotations

from tensorhooks.cli._harness import (
    Spread,
    Timings,
    check_target,
    cuda_event_seconds,
    interleaved,
    print_table,
    skip,
    verdict,
)
from tensorhooks.cli._models import (
    FusedAttentionBlock,
    NoOpMode,
    TinyTransformer,
    make_batch,
    mlp,
)

__all__ = [
    "FusedAttentionBlock",
    "NoOpMode",
    "Spread",
    "Timings",
    "TinyTransformer",
    "check_target",
    "cuda_event_seconds",
    "interleaved",
    "make_batch",
    "mlp",
    "print_table",
    "skip",
    "verdict",
]
