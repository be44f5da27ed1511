"""``python -m tensorhooks demo|bench``: see `tensorhooks.cli`."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
