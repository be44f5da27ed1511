"""The command line, ``python -m tensorhooks demo|bench``: see `tensorhooks.cli._main`.

Not part of the library's API: it draws with rich and charts with matplotlib, which come with the
``cli`` extra (``pip install 'tensorhooks[cli]'``).
"""

from ._main import main

__all__ = ["main"]
