"""Machine info and output: commit, machine, tables, JSON under ``docs/bench/``, plots."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_model import REPO

# ----------------------------------------------------------------------------------------------------------
# Machine info
# ----------------------------------------------------------------------------------------------------------


def git_commit() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    changed = [line[3:] for line in dirty if line.strip()]
    return f"{rev} + uncommitted changes in {', '.join(changed)}" if changed else (rev or None)


def machine_info(cfg: dict[str, Any]) -> dict[str, Any]:
    import flatshard

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flatshard": getattr(flatshard, "__version__", None),
        "git_commit": git_commit(),
        "loadavg_at_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    if cfg["device"] == "cuda" and torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------------------------------------
# Output: tables, JSON, plots
# ----------------------------------------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


def failed_row(name: str, result: dict[str, Any], width: int = 90) -> list[str]:
    """A table row for a contender that failed: its name and the last line of its error."""
    err = str(result.get("error", "")).strip().splitlines()
    return [name, "FAILED: " + (err[-1] if err else "?")[:width]]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A padded Markdown table; a row of two cells is a failed contender (its name and the error)."""
    widths = [max([len(h), *(len(r[i]) for r in rows if len(r) > 2)]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in rows:
        if len(r) == 2:
            lines.append(f"| {r[0].ljust(widths[0])} | {r[1]} |")
        else:
            lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in text.strip().splitlines()[-12:])


def utc_now() -> str:
    """The current UTC time, to the second (ISO 8601): the ``date`` of a report."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_out(filename: str) -> Path:
    """Where a result goes unless ``--out`` says otherwise: ``docs/bench/<filename>``."""
    return REPO / "docs" / "bench" / filename


def write_json(
    path: Path,
    report: Any,
    *,
    indent: int = 2,
    default: Callable[[Any], Any] | None = None,
    newline: bool = True,
) -> None:
    """``report`` as JSON (``default``: for what json cannot encode) with a final newline, unless
    ``newline=False``."""
    path.write_text(json.dumps(report, indent=indent, default=default) + ("\n" if newline else ""))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str) -> None:
    """Title, tight layout, PNG at 120 dpi, then close the figure."""
    plt = pyplot()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
