"""The environment probe: GPU, driver, link, torch, CUDA, cuDNN, NCCL and the source measured.

Runs first, in a process of its own like every part (a CUDA initialisation that hangs stops
only the probe). The runner reads ``cuda_available`` from its data to skip the CUDA parts on a
machine without CUDA. The source is named by its git commit when the checkout has one and, in
any case, by a hash of the package's and the benchmarks' Python files, so that figures can be
matched to the code they measured even where the copy of the tree carries no ``.git``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .record import OK, Recorder

NVIDIA_SMI_FIELDS = (
    "driver_version",
    "pcie.link.gen.max",
    "pcie.link.width.max",
    "pcie.link.gen.current",
    "pcie.link.width.current",
)


def source_sha256(root: Path) -> str:
    """The first 12 hex digits of a hash of ``tensorhooks/`` and ``benchmarks/`` Python files."""
    digest = hashlib.sha256()
    for folder in ("tensorhooks", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit(root: Path) -> str | None:
    """The checkout's commit (with ``+changes`` when the tree differs from it), if it has one."""
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],  # git from PATH
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def nvidia_smi() -> dict[str, str]:
    """Driver version and PCIe link of GPU 0 from ``nvidia-smi``; empty when it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ",".join(NVIDIA_SMI_FIELDS)
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=8,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [value.strip() for value in done.stdout.strip().split(",")]
    return dict(zip(NVIDIA_SMI_FIELDS, values, strict=False))


def _pcie(smi: dict[str, str]) -> str | None:
    if "pcie.link.gen.max" not in smi:
        return None
    return (
        f"gen {smi['pcie.link.gen.max']} x{smi['pcie.link.width.max']} (now gen "
        f"{smi.get('pcie.link.gen.current', '?')} x{smi.get('pcie.link.width.current', '?')})"
    )


def probe(rec: Recorder, root: Path) -> dict[str, Any]:
    """Everything the report names about the machine and the software, recorded as found.

    Whether CUDA is available is recorded first, so that a probe stopped later (a slow
    ``nvidia-smi``) still lets the runner start the CUDA parts.
    """
    import torch  # noqa: PLC0415  # the runner's own process imports no torch

    import tensorhooks  # noqa: PLC0415

    data: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "tensorhooks": tensorhooks.__version__,
    }
    _put(rec, data)
    if not data["cuda_available"]:
        data["no_cuda_reason"] = (
            "torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
        )
    else:
        properties = torch.cuda.get_device_properties(0)
        data |= {
            "gpu": torch.cuda.get_device_name(0),
            "gpus": torch.cuda.device_count(),
            "capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
            "memory_gib": properties.total_memory / 2**30,
            "cudnn": torch.backends.cudnn.version(),
        }
        try:
            data["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError, TypeError):
            data["nccl"] = None
    _put(rec, data)
    data |= {"commit": git_commit(root), "source_sha256": source_sha256(root)}
    if data["cuda_available"]:
        smi = nvidia_smi()
        data |= {"driver": smi.get("driver_version"), "pcie": _pcie(smi)}
    _put(rec, data)
    return data


def _put(rec: Recorder, data: dict[str, Any]) -> None:
    for key, value in data.items():
        if rec.result["data"].get(key, object()) != value:
            rec.put(key, value)


def run(rec: Recorder, ctx: Any) -> None:
    """Probe the machine and record what was found."""
    data = probe(rec, ctx.root)
    if data["cuda_available"]:
        summary = (
            f"{data['gpu']}, driver {data['driver']}, torch {data['torch']}, CUDA {data['cuda']}"
        )
    else:
        summary = f"no CUDA device ({data['no_cuda_reason']}); torch {data['torch']}"
    rec.finish(OK, summary)
