"""A griffe extension for the docs build: read ``Example:`` as Google's ``Examples:`` section.

The package's docstrings head their runnable example ``Example:``. Griffe's Google parser knows
only ``Examples:`` as the examples section, and renders any other title as an admonition whose
body is Markdown, where the ``>>>`` prompts become nested blockquotes. This extension renames
the title when griffe loads a docstring, so every example renders as highlighted code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object as it is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
