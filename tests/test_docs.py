"""The Python examples of the documentation run, and do what they say.

Every ```python block of README.md and docs/*.md is executed, the blocks of one page in order in
one namespace, as a reader would paste them. A block that puts tensors on a GPU (``.cuda()``,
``device="cuda"``, ``torch.cuda.<anything but is_available>``), or that is preceded by the HTML
comment ``<!-- test: cuda -->``, runs only where CUDA is available. ``<!-- test: skip REASON -->``
marks a block that is not run (one that needs several processes, say); the reason is required.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
NEEDS_CUDA = re.compile(r"""\.cuda\(\)|device=["']cuda|torch\.cuda\.(?!is_available\b)""")
BLOCK = re.compile(
    r"(?:<!-- test: (?P<marker>[^>]*?) -->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```", re.M | re.S
)


def python_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, marker, code) of every python block of a page."""
    text = page.read_text()
    return [
        (text.count("\n", 0, match.start("code")) + 1, match["marker"] or "", match["code"])
        for match in BLOCK.finditer(text)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_page_examples_run(page: Path) -> None:
    """Each python block of the page runs without error; its asserts hold."""
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, marker, code in python_blocks(page):
        if marker.startswith("skip"):
            assert marker.removeprefix("skip").strip(), f"{page.name}:{line}: give a reason to skip"
            continue
        cuda = marker == "cuda" or NEEDS_CUDA.search(code) is not None
        if cuda and not torch.cuda.is_available():
            continue
        assert marker in ("", "cuda"), f"{page.name}:{line}: unknown marker {marker!r}"
        compiled = compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compiled, namespace)  # the documentation's own example is the test


def test_gpu_blocks_are_recognised() -> None:
    """Blocks that need a GPU are told apart from those that only ask whether there is one."""
    assert NEEDS_CUDA.search('x = torch.ones(2, device="cuda")')
    assert NEEDS_CUDA.search("model.cuda()")
    assert NEEDS_CUDA.search("torch.cuda.synchronize()")
    assert not NEEDS_CUDA.search('device = "cuda" if torch.cuda.is_available() else "cpu"')


def test_every_page_has_examples_found() -> None:
    """The block pattern finds the API pages' examples (a guard against a broken pattern)."""
    for name in (
        "saved_tensors_hooks",
        "disable_saved_tensors_hooks",
        "register_multi_grad_hook",
        "save_on_cpu",
        "allow_mutation_on_saved_tensors",
        "distributed",
    ):
        assert len(python_blocks(ROOT / "docs" / f"{name}.md")) >= 3, name
