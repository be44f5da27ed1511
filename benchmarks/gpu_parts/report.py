"""The GPU runner's Markdown report, from the same record as ``gpu-results.json``.

The report names the machine and the software first (GPU, driver, torch, CUDA), then one line
per part, every design target with its verdict, and each part's tables, ready to paste into
``docs/performance.md``. A part that failed or ran out of time shows the end of its output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .record import targets_met


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table; columns after the first are right-aligned when numeric.

    Example:
        >>> print("\\n".join(markdown_table(["name", "ms"], [["a", "1.0"]])))
        | name | ms |
        |---|---:|
        | a | 1.0 |
    """
    align = ["---"] + [
        "---:" if _numeric_column(rows, i) else "---" for i in range(1, len(columns))
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _numeric_column(rows: Sequence[Sequence[str]], index: int) -> bool:
    cells = [str(row[index]) for row in rows if index < len(row)]
    measured = [cell for cell in cells if cell.strip() not in ("", "-")]
    return bool(measured) and all(_numeric(cell) for cell in cells)


def _numeric(cell: str) -> bool:
    head = cell.strip().split(" ")[0].rstrip("x%")
    try:
        float(head.replace(",", ""))
    except ValueError:
        return head in ("-", "")
    return True


def _cell(cell: object) -> str:
    return str(cell).replace("|", "\\|").replace("\n", " ")


def environment_lines(env: Mapping[str, Any]) -> list[str]:
    """The machine and the software the figures come from, in two sentences."""
    if not env:
        return ["Environment: not probed (the probe did not finish)."]
    if env.get("cuda_available"):
        details = [f"compute capability {env.get('capability', '?')}"]
        if env.get("memory_gib") is not None:
            details.append(f"{env['memory_gib']:.1f} GiB")
        if env.get("pcie"):
            details.append(f"PCIe {env['pcie']}")
        gpu = (
            f"**GPU**: {env.get('gpu', '?')} ({', '.join(details)}), "
            f"driver {env.get('driver', 'unknown')}."
        )
    else:
        gpu = f"**GPU**: none (no CUDA device: {env.get('no_cuda_reason', 'unknown')})."
    software = (
        f"**Software**: torch {env.get('torch', '?')} (CUDA {env.get('cuda') or 'none'}, cuDNN "
        f"{env.get('cudnn') or 'none'}, NCCL {env.get('nccl') or 'none'}), Python "
        f"{env.get('python', '?')}, tensorhooks {env.get('tensorhooks', '?')} (commit "
        f"{env.get('commit') or 'unknown'}, source sha256 {env.get('source_sha256', '?')}), "
        f"{env.get('cpus', '?')} CPUs, {env.get('platform', '?')}."
    )
    return [gpu, "", software]


def _status(part: Mapping[str, Any]) -> str:
    status = str(part["status"])
    return status if status in ("ok", "skipped") else f"**{status}**"


def _time(part: Mapping[str, Any]) -> str:
    if part.get("seconds") is None:
        return f"- ({part['limit_s']:.0f} s)"
    return f"{part['seconds']:.0f} s ({part['limit_s']:.0f} s)"


def summary_line(part: Mapping[str, Any]) -> str:
    """A part's one line on stdout: status, time against its limit, and what it found.

    Example:
        >>> summary_line({"name": "x", "status": "skipped", "reason": "no CUDA", "summary": ""})
        '[x] skipped: no CUDA'
    """
    if part["status"] == "skipped":
        return f"[{part['name']}] skipped: {part.get('reason') or 'no reason given'}"
    head = f"[{part['name']}] {part['status']} in {part['seconds']:.1f} s"
    head += f" (limit {part['limit_s']:.0f} s)"
    text = part.get("summary") or ""
    met = targets_met(part.get("targets", []))
    if met:
        text = f"{text}; {met}" if text else met
    reason = part.get("reason")
    if reason and part["status"] != "ok":
        text = f"{text}; {reason}" if text else reason
    return f"{head}: {text}" if text else head


def render(run: Mapping[str, Any]) -> str:
    """The whole report, as Markdown."""
    env = run.get("environment") or {}
    title = env.get("gpu") if env.get("cuda_available") else "no CUDA device"
    lines = [f"# GPU run: {title}", ""]
    lines += environment_lines(env)
    lines += [
        "",
        f"Command: `{run.get('command', '?')}`, started {run.get('started', '?')}, "
        f"{run.get('seconds', 0):.0f} s in all (time budget {run.get('budget_s', 0):.0f} s)."
        + (" **Dry run on the CPU, at tiny sizes: not figures.**" if run.get("dry_run") else ""),
        "",
    ]
    parts = run.get("parts", [])
    rows = [
        [part["title"], _status(part), _time(part), _part_text(part)]
        for part in parts
        if part["name"] != "environment"
    ]
    lines += markdown_table(["part", "status", "time (limit)", "summary"], rows)
    targets = [target for part in parts for target in part.get("targets", [])]
    if targets:
        lines += ["", "## Design targets", ""]
        lines += markdown_table(
            ["part", "target", "measured", "bound", "verdict", "what limits it / numbers"],
            [
                [t["part"], t["name"], t["shown"], t["bound"], _verdict(t), t.get("detail", "")]
                for t in targets
            ],
        )
    for part in parts:
        if part["name"] != "environment":
            lines += ["", *_section(part)]
    return "\n".join(lines) + "\n"


def _verdict(target: Mapping[str, Any]) -> str:
    verdict = str(target.get("verdict", "not measured"))
    return f"**{verdict}**" if verdict == "MISSED" else verdict


def _part_text(part: Mapping[str, Any]) -> str:
    if part["status"] == "skipped":
        return f"skipped: {part.get('reason') or 'no reason given'}"
    text = part.get("summary") or ""
    met = targets_met(part.get("targets", []))
    reason = part.get("reason") if part["status"] != "ok" else None
    return "; ".join(item for item in (text, met, reason) if item)


def _section(part: Mapping[str, Any]) -> list[str]:
    lines = [f"## {part['title']}", ""]
    if part["status"] == "skipped":
        return [*lines, f"skipped: {part.get('reason') or 'no reason given'}"]
    lines.append(f"Status: {_status(part)}, {_time(part)}. {_part_text(part)}")
    lines += [f"\n{note}" for note in part.get("notes", [])]
    for table in part.get("tables", []):
        lines += ["", f"**{table['title']}**", ""]
        lines += markdown_table(table["columns"], table["rows"])
        lines += [f"\n{note}" for note in table.get("notes", [])]
    tail = part.get("log_tail")
    if tail and part["status"] != "ok":
        lines += ["", "End of its output:", "", "```text", tail.rstrip("\n"), "```"]
    return lines
