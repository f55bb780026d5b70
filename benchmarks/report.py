"""The one report path: machine info, ratios, the Markdown table, the plot, the files."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .model import REPO
from .schema import Report, Row

DOCS_BENCH = REPO / "docs" / "bench"


@dataclass(frozen=True)
class Column:
    """A table column: ``key`` is a metric (a list is per rank, shown ``a / b``), ``÷metric``: the reference
    row's value over this row's, or ``/metric``: this row's over the reference's (``1`` on the reference)."""

    header: str
    key: str
    spec: str = ".3f"


@dataclass(frozen=True)
class Panel:
    """A plot panel: bars per row for each metric, or with ``x`` (a metric) one line per series (the row's
    ``series`` metric, else its contender) for each metric; ``select``: only rows whose label contains it."""

    title: str
    metrics: tuple[str, ...]
    x: str | None = None
    log: bool = False
    select: str | None = None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """The short commit, and the files under ``src/`` with uncommitted changes (flatshard as measured)."""
    try:
        git = ["git", "-C", str(REPO)]
        rev = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    changed = [line[3:] for line in dirty.stdout.splitlines() if line.strip()]
    commit = rev.stdout.strip() or None
    return f"{commit} + uncommitted changes in {', '.join(changed)}" if changed else commit


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import flatshard

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flatshard": getattr(flatshard, "__version__", None),
        "git_commit": git_commit(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
    return info


def scalar(v: Any) -> float | None:
    """A metric as one number: a per-rank list by its largest value."""
    if isinstance(v, list):
        v = max((x for x in v if x is not None), default=None)
    return None if v is None or isinstance(v, str) else float(v)


def compute_ratios(
    rows: list[Row], metrics: tuple[str, ...], pairs: list[tuple[str, str]]
) -> dict[str, dict[str, float | None]]:
    """``a ÷ b`` for every metric and pair of rows that both ran and passed their check."""
    by = {r.name: r for r in rows if r.ok}
    out: dict[str, dict[str, float | None]] = {}
    for a, b in pairs:
        if a in by and b in by and a != b:
            ratio = {}
            for m in metrics:
                x, y = scalar(by[a].metrics.get(m)), scalar(by[b].metrics.get(m))
                ratio[m] = None if x is None or not y else x / y
            out[f"{a} ÷ {b}"] = ratio
    return out


def fmt(v: Any, spec: str = ".3f") -> str:
    if isinstance(v, list):
        return " / ".join(fmt(x, spec) for x in v)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    return format(v, spec)


def table(rows: list[Row], columns: list[Column], reference: str) -> str:
    """The Markdown table: a row per :class:`Row`; a failed one shows its error, a failed check why."""
    ref = next((r for r in rows if r.name == reference and r.ok), None)
    lines = [
        "| " + " | ".join(["row", *(c.header for c in columns)]) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for r in rows:
        if r.status == "failed":
            lines.append(f"| {r.name} | FAILED: {(r.error or '?').strip().splitlines()[-1][:100]} |")
            continue
        cells = [r.name if r.ok else f"{r.name} (CHECK FAILED: {r.check.get('why', '?')})"]
        for c in columns:
            if c.key[0] not in "÷/":
                cells.append(fmt(r.metrics.get(c.key), c.spec))
            elif ref is None or not r.ok:
                cells.append("-")
            elif r is ref:
                cells.append("1")
            else:
                x, y = scalar(ref.metrics.get(c.key[1:])), scalar(r.metrics.get(c.key[1:]))
                x, y = (y, x) if c.key[0] == "/" else (x, y)
                cells.append(fmt(None if x is None or not y else x / y, c.spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: Report, panels: list[Panel], path: Path) -> bool:
    """One figure, a panel per :class:`Panel`; flatshard's rows in blue. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 5.5 * len(panels)), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rows = [r for r in report.rows if r.ok and (panel.select is None or panel.select in r.label)]
        if panel.x is None:
            _bars(ax, rows, panel)
        else:
            _lines(ax, rows, panel)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if panel.log:
            ax.set_yscale("log")
            if panel.x is not None:
                ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report.stem}: {report.date[:10]}, torch {report.machine.get('torch')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _bars(ax: Any, rows: list[Row], panel: Panel) -> None:
    per_metric = 0.8 / len(panel.metrics)
    for j, m in enumerate(panel.metrics):
        for i, r in enumerate(rows):
            values = r.metrics.get(m)
            values = values if isinstance(values, list) else [values]
            width = per_metric / len(values)
            for k, v in enumerate(values):
                x = i - 0.4 + j * per_metric + (k + 0.5) * width
                color = f"C{j}" if r.contender.startswith("flatshard") else "0.6"
                hatch = None if r.contender.startswith("flatshard") else "//"
                label = m if i == 0 and k == 0 else None
                ax.bar(x, v or 0.0, width * 0.9, color=color, hatch=hatch, edgecolor=f"C{j}", label=label)
    ax.set_xticks(range(len(rows)), [r.name for r in rows], rotation=20, ha="right", fontsize=7)


def _lines(ax: Any, rows: list[Row], panel: Panel) -> None:
    series: dict[str, list[Row]] = {}
    for r in rows:
        series.setdefault(str(r.metrics.get("series", r.contender)), []).append(r)
    for s, (name, members) in enumerate(series.items()):
        for j, m in enumerate(panel.metrics):
            pts = sorted(
                (scalar(r.metrics[panel.x]), scalar(r.metrics.get(m))) for r in members if m in r.metrics
            )
            if not pts:
                continue
            style = ("-", "--", ":", "-.")[j % 4]
            ax.plot(
                *zip(*pts),
                style,
                marker="o",
                color=f"C{s}",
                label=f"{name}: {m}" if len(panel.metrics) > 1 else name,
            )
    ax.set_xlabel(panel.x)


def write(report: Report, out: Path, panels: list[Panel]) -> list[Path]:
    """``out`` (a ``.json`` path, or a directory for ``STEM.json``) and the plot beside it."""
    path = out if out.suffix == ".json" else out / f"{report.stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.to_json())
    png = path.with_suffix(".png")
    return [path, png] if panels and plot(report, panels, png) else [path]
