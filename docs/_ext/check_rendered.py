"""Check the built documentation site: every API example renders as code, every name has a page.

Run after ``mkdocs build``: ``python docs/_ext/check_rendered.py site``. Exits 1 with one line
per problem. ``mkdocs build --strict`` cannot see these: a docstring example rendered as nested
blockquotes is valid HTML.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# A docstring example section, then the first element after its title.
_SECTION = re.compile(
    r'<span class="doc-section-title">(Examples?):</span></p>\s*(<[^>]*>)', re.MULTILINE
)
_PROMPT_AS_QUOTE = re.compile(r"<blockquote>\s*<blockquote>|<p>&gt;&gt;&gt;|<p>\.\.\. ")
_ADMONITION_EXAMPLE = re.compile(r'<details class="example"|<div class="admonition example"')


def problems(site: Path, names: list[str]) -> list[str]:
    """Every problem found in the built ``site``; ``names`` must each have an anchor."""
    found: list[str] = []
    anchors: set[str] = set()
    examples = 0
    for page in sorted(site.rglob("*.html")):
        html = page.read_text()
        anchors |= set(re.findall(r'id="(tensorhooks\.[\w.]+)"', html))
        where = page.relative_to(site).as_posix()
        for match in _SECTION.finditer(html):
            examples += 1
            if not match[2].startswith('<div class="highlight"'):
                found.append(f"{where}: an Examples section renders as {match[2]!r}, not code")
        if _PROMPT_AS_QUOTE.search(html):
            found.append(f"{where}: >>> prompts render as Markdown quotes or text")
        if _ADMONITION_EXAMPLE.search(html):
            found.append(f"{where}: an Example section renders as an admonition")
    if examples == 0:
        found.append("no docstring example found in the site (was the API reference built?)")
    found += [f"no reference for {name}" for name in names if name not in anchors]
    return found


def public_names(init: Path = Path("tensorhooks/__init__.py")) -> list[str]:
    """``tensorhooks.<name>`` for each name of ``__all__`` (read statically: no torch needed).

    The distributed module is checked by its function, ``sync_gradients``; the names re-exported
    from ``torch.autograd.graph`` unchanged are torch's to document.
    """
    tree = ast.parse(init.read_text())
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets)
    )
    # torch's own objects, re-exported unchanged: documented by torch (graph.md, checkpoint.md).
    from_torch = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and (
            node.module in ("_core.graph", "_core.torch_compat")
            or (node.level == 0 and str(node.module).startswith("torch"))
        )
        for alias in node.names
    }
    names = [
        f"tensorhooks.{name}"
        for name in exported
        if name != "distributed" and name not in from_torch
    ]
    return [*names, "tensorhooks.distributed.sync_gradients"]


def main() -> int:
    """Check the site directory given as the only argument."""
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    found = problems(site, public_names())
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
