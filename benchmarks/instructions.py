"""Instructions per training step under each context, counted by callgrind: stable under load.

Wall-clock ratios on a shared machine move by several percent between runs; the number of
instructions a step executes does not. This script runs a few steps of the tiny
Llama/Mixtral-style transformer (or the 50-layer MLP) under one context with callgrind's
collection switched on around the measured steps only (start-up and warm-up are not counted),
and prints instructions per step. Compare contexts by running it once per context:

    for c in plain torch_hooks ours_hooks torch_offload ours_offload \\
             bare_mode bare_mode_no_dynamo torch_mutation ours_mutation; do
        valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \\
            --callgrind-out-file=/tmp/cg.$c python benchmarks/instructions.py $c
        callgrind_annotate /tmp/cg.$c.1 | grep "PROGRAM TOTALS"  # for --steps 4
    done

Needs valgrind's ``callgrind.h`` and a C compiler (it builds a four-line library that issues
callgrind's client requests); outside valgrind those requests do nothing and the count is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.autograd.graph as torch_graph

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation import BareModeNoDynamoWrapper

import tensorhooks
from tensorhooks.cli._harness import skip
from tensorhooks.cli._models import LlamaConfig, NoOpMode, TinyLlama, make_tokens, mlp

_CLIENT = r"""
#include <valgrind/callgrind.h>
void cg_start(void) {
    CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT;
}
void cg_stop(void) {
    CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION;
}
"""


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# name -> (context, whether backward runs inside it)
CONTEXTS: dict[str, tuple[Callable[[], Any], bool]] = {
    "plain": (contextlib.nullcontext, False),
    "torch_hooks": (lambda: torch_graph.saved_tensors_hooks(_identity, _identity), False),
    "ours_hooks": (lambda: tensorhooks.saved_tensors_hooks(_identity, _identity), False),
    "torch_offload": (torch_graph.save_on_cpu, False),
    "ours_offload": (tensorhooks.save_on_cpu, False),
    "bare_mode": (NoOpMode, True),
    "bare_mode_no_dynamo": (BareModeNoDynamoWrapper, True),
    "torch_mutation": (torch_graph.allow_mutation_on_saved_tensors, True),
    "ours_mutation": (tensorhooks.allow_mutation_on_saved_tensors, True),
}


def _client_library(directory: Path) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        skip("no C compiler to build the callgrind client requests")
    source = directory / "client.c"
    source.write_text(_CLIENT)
    library = directory / "client.so"
    done = subprocess.run(
        [str(compiler), "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        skip(f"could not build the callgrind client requests: {done.stderr.strip()}")
    return ctypes.CDLL(str(library))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("context", choices=list(CONTEXTS))
    parser.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--accumulate", action="store_true", help="keep .grad across steps (no zero_grad)"
    )
    parser.add_argument(
        "--optimizer", action="store_true", help="an SGD step after backward, as in training"
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="the MLP with one context per Linear+ReLU (contexts whose backward runs outside)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    context, backward_inside = CONTEXTS[args.context]
    if args.per_layer and (args.model != "mlp" or backward_inside):
        parser.error("--per-layer takes --model mlp and a context whose backward runs outside")
    if args.model == "transformer":
        config = LlamaConfig()
        model: torch.nn.Module = TinyLlama(config)
        tokens = make_tokens(config)

        def loss() -> torch.Tensor:
            return model(tokens)  # type: ignore[no-any-return]
    else:
        model = mlp(50)
        batch = torch.randn(8, 64)
        blocks = [model[index : index + 2] for index in range(0, len(model), 2)]

        def loss() -> torch.Tensor:
            if not args.per_layer:
                return model(batch).sum()  # type: ignore[no-any-return]
            h = batch
            for block in blocks:
                with context():
                    h = block(h)
            return h.sum()

    params = list(model.parameters())
    # lr 0: every update runs, the weights stay (the count does not depend on their values).
    sgd = torch.optim.SGD(params, lr=0.0) if args.optimizer else None
    outer = contextlib.nullcontext if args.per_layer else context

    def step() -> None:
        if not args.accumulate:
            for param in params:
                param.grad = None
        with outer():
            value = loss()
            if backward_inside:
                value.backward()  # type: ignore[no-untyped-call]
        if not backward_inside:
            value.backward()  # type: ignore[no-untyped-call]
        if sgd is not None:
            sgd.step()

    with tempfile.TemporaryDirectory() as directory:
        client = _client_library(Path(directory))
        for _ in range(3):
            step()
        gc.collect()
        client.cg_start()
        for _ in range(args.steps):
            step()
        client.cg_stop()
    print(f"{args.context} on the {args.model}: {args.steps} steps measured; read the count with")
    print("  callgrind_annotate <out-file>.1 | grep 'PROGRAM TOTALS'  (divide by --steps)")


if __name__ == "__main__":
    main()
