"""tensorhooks.integrations as a package: imported only when asked for, every name documented."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["tensorhooks.integrations.accelerate", "tensorhooks.integrations.transformers"]

_PROBE = """
import json, sys
import tensorhooks
print(json.dumps(sorted(name for name in ("transformers", "accelerate", "tensorhooks.integrations")
                        if name in sys.modules)))
"""


def test_import_tensorhooks_imports_no_integration() -> None:
    """`import tensorhooks` loads neither transformers, accelerate nor the integrations."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_reference(module: str) -> None:
    """Each name of an integration's __all__ has a `::: module.name` block on a docs page."""
    names = importlib.import_module(module).__all__
    pages = "\n".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))
    documented = set(re.findall(rf"^::: {re.escape(module)}\.(\w+)$", pages, re.M))
    assert set(names) <= documented
