"""``python -m tensorhooks demo|bench``: see `tensorhooks._cli`."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
