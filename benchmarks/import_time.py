"""How much `import tensorhooks` adds to `import torch`, measured in fresh processes.

Each round starts a new interpreter that times `import torch`, then `import tensorhooks`, in
that process (so torch's own cost is not counted twice); rounds alternate nothing else and are
repeated to show the spread. Target (docs/performance.md): at most 0.15 s over `import torch`.

    python benchmarks/import_time.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from harness import Spread, check_target

TARGET_SECONDS = 0.15

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
        "seconds import tensorhooks adds to import torch",
        Spread.of(extra),
        at_most=TARGET_SECONDS,
        unit=" s",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
