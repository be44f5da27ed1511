"""The Python examples of the documentation run, and do what they say.

Every ```python block of README.md and docs/*.md is executed, the blocks of one page in order in
one namespace, as a reader would paste them. A block that puts tensors on a GPU (``.cuda()``,
``device="cuda"``, ``torch.cuda.<anything but is_available>``), or that is preceded by the HTML
comment ``<!-- test: cuda -->``, runs only where CUDA is available. ``<!-- test: skip REASON -->``
marks a block that is not run (one that needs several processes, say); the reason is required.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

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
    # A real module, so that code inspecting a function's module (Dynamo imports it) finds it.
    module = types.ModuleType(f"docs_{page.stem}")
    namespace = module.__dict__
    sys.modules[module.__name__] = module
    try:
        _run_blocks(page, namespace)
    finally:
        del sys.modules[module.__name__]


def _run_blocks(page: Path, namespace: dict[str, object]) -> None:
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


def _check_rendered() -> Any:
    spec = importlib.util.spec_from_file_location(
        "check_rendered", ROOT / "docs" / "_ext" / "check_rendered.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_generated_reference() -> None:
    """Each name of tensorhooks.__all__ has a `::: tensorhooks.X` block on some page."""
    documented: set[str] = set()
    for page in (ROOT / "docs").glob("*.md"):
        documented |= set(re.findall(r"^::: (tensorhooks\.[\w.]+)", page.read_text(), re.M))
    assert set(_check_rendered().public_names(ROOT / "tensorhooks" / "__init__.py")) <= documented


def test_rendered_check_reads_examples_as_code() -> None:
    """The rendered-site check passes an example rendered as code, flags one rendered as quotes."""
    check = _check_rendered()
    code = '<span class="doc-section-title">Examples:</span></p>\n<div class="highlight"><pre>'
    quoted = '<details class="example" open>\n<blockquote>\n<blockquote>\n<p>&gt;&gt;&gt; import'
    anchor = '<h2 id="tensorhooks.x">'
    with tempfile.TemporaryDirectory() as directory:
        site = Path(directory)
        (site / "good.html").write_text(code + anchor)
        assert check.problems(site, ["tensorhooks.x"]) == []
        (site / "bad.html").write_text(quoted)
        assert check.problems(site, ["tensorhooks.x", "tensorhooks.y"]) == [
            "bad.html: >>> prompts render as Markdown quotes or text",
            "bad.html: an Example section renders as an admonition",
            "no reference for tensorhooks.y",
        ]


@pytest.mark.slow
def test_built_site_renders_every_example_as_code(tmp_path: Path) -> None:
    """`mkdocs build` (where the docs extra is installed) gives a site the check passes."""
    pytest.importorskip("mkdocstrings")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    check = _check_rendered()
    assert (
        check.problems(tmp_path / "site", check.public_names(ROOT / "tensorhooks" / "__init__.py"))
        == []
    )


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


# Third-party modules the examples and docs import, and the distribution that provides each.
_DISTRIBUTIONS = {
    "accelerate": "accelerate",
    "hypothesis": "hypothesis",
    "pytest": "pytest",
    "rich": "rich",
    "transformers": "transformers",
}


def test_readme_install_brings_what_every_example_imports() -> None:
    """The README's first command installs every module the examples and docs pages import."""
    command = next(c for c in _readme_commands() if "python -m tensorhooks demo" in c)
    extras = re.search(r'-e "\.\[([\w,]+)\]"', command)
    assert extras is not None, command
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    optional = {
        name: re.findall(r'"([^"]+)"', items)
        for name, items in re.findall(r"^(\w+) = \[(.*)\]", section.split("\n[")[0], re.M)
    }
    installed: set[str] = set()
    pending = extras[1].split(",")
    while pending:
        for requirement in optional[pending.pop()]:
            name = re.split(r"[<>=\[ ]", requirement, maxsplit=1)[0]
            if name == "tensorhooks":  # an extra naming others: tensorhooks[test,lint]
                pending += re.findall(r"\[([\w,]+)\]", requirement)[0].split(",")
            installed.add(name)
    sources = [path.read_text() for path in sorted((ROOT / "examples").glob("*.py"))]
    sources += [code for page in PAGES for _, _, code in python_blocks(page)]
    imported = {
        module
        for source in sources
        for module in _DISTRIBUTIONS
        if re.search(rf"^\s*(import|from) {module}\b", source, re.M)
    }
    assert {_DISTRIBUTIONS[module] for module in imported} <= installed


def test_readme_leads_with_code_and_the_cpu_wheel_comes_first() -> None:
    """An example comes within the first 30 lines; the CPU-wheel step precedes the first install."""
    text = (ROOT / "README.md").read_text()
    first_code = text.index("```python")
    assert text.count("\n", 0, first_code) < 30
    cpu_wheel = text.index("download.pytorch.org/whl/cpu")
    assert cpu_wheel < text.index('pip install -c constraints.txt -e ".[')


def test_readme_docs_server_line_has_ruff() -> None:
    """The README's mkdocs serve line installs ruff, which wraps long signatures."""
    serve = next(c for c in _readme_commands() if "mkdocs serve" in c)
    assert re.search(r"\bruff\b", serve)


def test_errors_are_named_by_their_class_name_outside_the_errors_page() -> None:
    """README and docs name an error by its class name; its earlier alias only on errors.md."""
    import tensorhooks

    aliases = [
        name
        for name in tensorhooks.__all__
        if isinstance(value := getattr(tensorhooks, name), type)
        and issubclass(value, BaseException)
        and value.__name__ != name
        and value.__module__.startswith("tensorhooks")
    ]
    assert aliases  # the four earlier names
    for page in PAGES:
        if page.name != "errors.md":
            named = [alias for alias in aliases if alias in page.read_text()]
            assert named == [], f"{page.name} names {named}; use the class names"
