"""Every CUDA test and GPU benchmark in one command, each part under its own time limit.

Run from the repository root, with no install step (the parts' processes get the checkout on
their ``PYTHONPATH``):

    python benchmarks/gpu.py --out DIR [--only PART,...] [--skip PART,...] [--budget 440]

Parts, in order (``--list`` prints them with their limits): the environment probe (GPU,
driver, torch, CUDA), ``pytest -m cuda``, the offload tests under ``TORCH_CUDA_SANITIZER=1``,
``save_on_cpu(pin_memory=True)`` on a bf16 transformer, ``checkpoint`` policies, parameter
offloading against FSDP2's CPU offload and fairscale's ``OffloadModel``, ``sync_gradients``
over NCCL against DDP, and the activation planner's GPU rows (``benchmarks/plan.py --gpu``,
when that script exists), and FSDP2 over NCCL on every GPU (``benchmarks/fsdp2.py --gpu``
under torchrun: plans against torch's ``checkpoint``, per rank). Writes ``DIR/gpu-report.md``
(tables for docs/performance.md, the design targets as met or MISSED),
``DIR/gpu-results.json`` and ``DIR/gpu-log.txt``, and prints one line per part as it finishes.
Without CUDA every part prints ``skipped: no CUDA``; with
``--dry-run`` every part runs on the CPU at tiny sizes (checks the code, measures nothing).
Exits 1 when a part failed or ran out of time, else 0 (a missed target is not a failure).
See benchmarks/gpu_parts/runner.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_parts.runner import main

if __name__ == "__main__":
    sys.exit(main())
