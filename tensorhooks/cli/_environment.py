"""Where the command line runs: tensorhooks' version, the ``cli`` extra, the machine in words."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import importlib.util
import os
import platform
import sys

import torch

__all__ = ["EXTRAS", "environment", "machine", "missing_extras", "version"]

EXTRAS = ("rich", "matplotlib")
"""The packages of the ``cli`` extra: rich draws the tables, matplotlib the bench's chart."""


def version() -> str:
    """Tensorhooks' version, from the installed package's metadata."""
    try:
        return importlib.metadata.version("tensorhooks")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing_extras() -> list[str]:
    """The packages of the ``cli`` extra that are not installed."""
    return [name for name in EXTRAS if importlib.util.find_spec(name) is None]


@functools.cache
def _cpu_name() -> str:
    """The CPU's model name, as ``lscpu`` (Linux) or ``sysctl`` (macOS) reports it."""
    from torch.utils import collect_env  # noqa: PLC0415  # only a report needs it

    info: str = collect_env.get_cpu_info(collect_env.run)  # type: ignore[no-untyped-call]
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Name"):
            return value.strip()
    if sys.platform == "darwin" and info.strip():
        return info.strip()
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> str:
    """The machine in words: the CPU (or the GPU when ``device`` is CUDA), cores, OS.

    Example:
        >>> "logical CPUs" in machine()
        True
    """
    cpu = f"{_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}; {cpu}"
    return cpu


def environment(device: str = "cpu") -> str:
    """One line: versions, machine and date, for every report the command line makes."""
    today = datetime.date.today().isoformat()
    return (
        f"tensorhooks {version()}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, on {machine(device)}, {today}"
    )
