"""The program generator's options: backward variants, region kinds, programs that run as Python."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, find, given, settings

import tensorhooks
from tensorhooks._testing.programs import BACKWARDS
from tensorhooks.testing import (
    CheckArgumentValueError,
    GradientMismatchError,
    Program,
    assert_hooks_preserve_gradients,
    programs,
)

ROOT = Path(__file__).resolve().parents[2]
FIND = settings(database=None, derandomize=True, max_examples=1000, phases=[Phase.generate])
SINGLE = ("backward", "inputs", "grad")
# What each backward variant's source says, and nothing else does.
VARIANTS = {
    "backward": "    loss.backward()\n    grads = [t.grad for t in",
    "inputs": "loss.backward(inputs=",
    "grad": "grads = list(torch.autograd.grad(loss",
    "twice": "loss.backward(retain_graph=True)",
    "double": "create_graph=True",
    "thread": "worker = threading.Thread(target=on_thread)",
}


@given(program=programs(backwards=["grad"]))
def test_only_the_chosen_backward_variant_is_drawn(program: Program) -> None:
    """With backwards=["grad"], every program runs torch.autograd.grad and no other variant."""
    assert [name for name, sign in VARIANTS.items() if sign in program.source] == ["grad"]


@pytest.mark.parametrize("variant", BACKWARDS)
def test_every_backward_variant_is_drawn(variant: str) -> None:
    """Each variant of BACKWARDS shows in some drawn program."""
    found = find(
        programs(),
        lambda program: VARIANTS[variant] in program.source,
        settings=FIND,
    )
    assert VARIANTS[variant] in found.source


@pytest.mark.parametrize(
    "options",
    [
        {"backwards": []},
        {"backwards": ["backward", "thrice"]},
        {"checkpoint": ["views"]},
        {"checkpoint": "outside"},
    ],
    ids=["no_backward", "unknown_backward", "unknown_kind", "kind_as_string"],
)
def test_unknown_options_are_refused(options: dict[str, object]) -> None:
    """An unknown backward variant or region kind raises CheckArgumentValueError at once."""
    with pytest.raises(CheckArgumentValueError, match=r"programs\((backwards|checkpoint)=.*pass"):
        programs(**options)  # type: ignore[arg-type]


def _freeing_pair() -> tuple[object, object]:
    """A pair that frees what it stored on unpack: one backward per graph, as a disk cache."""
    store: dict[int, torch.Tensor] = {}
    keys = itertools.count()

    def pack(tensor: torch.Tensor) -> int:
        key = next(keys)
        store[key] = tensor.detach().clone()
        return key

    return pack, store.pop


def test_a_pair_that_frees_on_unpack_passes_on_single_backwards() -> None:
    """Leaving out "twice" and "double" checks a pair that pops what it stored."""
    assert_hooks_preserve_gradients(*_freeing_pair(), backwards=SINGLE, max_examples=40)


def test_a_pair_that_frees_on_unpack_fails_on_a_second_backward() -> None:
    """With every variant, the second backward finds what the freeing pair popped missing."""
    with pytest.raises(GradientMismatchError, match=r"raised where plain autograd does not"):
        assert_hooks_preserve_gradients(*_freeing_pair(), writes=False, max_examples=200)


def _runs(program: Program) -> bool:
    """Whether plain autograd runs the program (it may refuse it: a random in-place write)."""
    try:
        program.run(program.make_leaves())
    except (RuntimeError, ValueError):  # ValueError: a lazy module's parameter
        return False
    return True


def test_a_drawn_program_runs_as_a_python_script(tmp_path: Path) -> None:
    """The source of a program with every kind of region runs on its own, as printed."""
    program = find(
        programs(checkpoint=True),
        lambda p: (
            all(s in p.source for s in ("context_fn=contexts", "count", "def region1")) and _runs(p)
        ),
        settings=FIND,
    )
    script = tmp_path / "program.py"
    script.write_text(f"{program.source}\nprint(len(program(make_leaves())))\n")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) == len(program.run(program.make_leaves()))


def test_programs_run_their_regions_through_the_given_checkpoint() -> None:
    """Program.run(checkpoint=...) replaces tensorhooks.checkpoint for the program's regions."""
    program = find(
        programs(checkpoint=()), lambda p: "def region0" in p.source and _runs(p), settings=FIND
    )
    calls: list[str] = []

    def counting(function: object, *args: object, **kwargs: object) -> object:
        calls.append(getattr(function, "__name__", ""))
        return tensorhooks.checkpoint(function, *args, **kwargs)  # type: ignore[arg-type]

    program.run(program.make_leaves(), checkpoint=counting)
    assert calls[0] == "region0"
