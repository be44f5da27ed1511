"""How much `import tensorhooks` adds to `import torch`, measured in fresh processes.

Each round starts a new interpreter that times `import torch`, then `import tensorhooks`, in
that process (so torch's own cost is not counted twice); rounds are repeated to show the
spread. Target (docs/performance.md): at most 0.15 s over `import torch` where torch imports in
about 1 s, read as a share: tensorhooks' import at most 15% of torch's own, in the same round.
A loaded machine slows both imports of a round alike, so the share holds where the seconds do
not; the verdict is the one rule's (see NOTE [Reading a ratio from its rounds]), on the share of
every round.

    python benchmarks/import_time.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from harness import Spread, check_target

TARGET_SHARE = 0.15
"""tensorhooks' import over torch's, at most: 0.15 s where torch's own import takes 1 s."""

_PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
import tensorhooks
end = time.perf_counter()
print(json.dumps({"torch": middle - start, "tensorhooks": end - middle,
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def measure(rounds: int) -> list[dict[str, float]]:
    """One fresh interpreter per round: the seconds of each import, and whether Dynamo loaded."""
    results = []
    for _ in range(rounds):
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
        )
        results.append(json.loads(done.stdout.splitlines()[-1]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    options = parser.parse_args()
    results = measure(options.rounds)
    torch_s = [r["torch"] for r in results]
    extra = [r["tensorhooks"] for r in results]
    print(
        f"import torch: median {statistics.median(torch_s):.3f} s "
        f"({min(torch_s):.3f}-{max(torch_s):.3f}), {options.rounds} rounds"
    )
    print(
        f"import tensorhooks after it: median {statistics.median(extra):.3f} s "
        f"({min(extra):.3f}-{max(extra):.3f})"
    )
    print(f"torch._dynamo imported by tensorhooks: {any(r['dynamo'] for r in results)}")
    check_target(
        "import tensorhooks over import torch, per round",
        Spread.of([r["tensorhooks"] / r["torch"] for r in results]),
        at_most=TARGET_SHARE,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
