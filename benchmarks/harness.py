"""What the benchmark scripts share, re-exported from the package (`tensorhooks.cli._harness`).

Kept so that scripts can write ``from harness import interleaved, mlp, print_table``;
the timing code, the models and the one rule that reads a ratio (`tensorhooks.cli._verdict`)
live in the package, once (see NOTE [How tensorhooks times things] there).
"""

from __future__ import annotations

from tensorhooks.cli._harness import (
    Timings,
    check_target,
    cuda_event_seconds,
    interleaved,
    print_table,
    skip,
)
from tensorhooks.cli._models import (
    FusedAttentionBlock,
    NoOpMode,
    TinyTransformer,
    make_batch,
    mlp,
)
from tensorhooks.cli._verdict import Spread, target_verdict, verdict

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
    "target_verdict",
    "verdict",
]
