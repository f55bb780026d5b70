"""memory.py's report: the plot against model size, the tables of measured against theory, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench_output import pyplot, save_figure

__all__ = ["format_side_by_side", "format_table", "format_theory", "plot"]


def plot(
    rows: list[dict[str, Any]], worlds: list[int], allocators: list[str], path: Path, title: str
) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(allocators), figsize=(6.5 * len(allocators), 5), sharey=True, squeeze=False
    )
    for ax, alloc in zip(axes[0], allocators, strict=True):
        for i, w in enumerate(worlds):
            pts = sorted(
                (r["num_params"], r["measured_mib_max_rank"], r["theory_mib"])
                for r in rows
                if r["world"] == w and r["allocator"] == alloc and r["contender"] == "flatshard"
            )
            if not pts:
                continue
            x = [p[0] / 1e6 for p in pts]
            ax.plot(x, [p[1] for p in pts], "o-", color=f"C{i}", label=f"N={w} measured (max over ranks)")
            ax.plot(x, [p[2] for p in pts], "x--", color=f"C{i}", label=f"N={w} theory")
        widest = max(worlds)
        peers = [c for c in dict.fromkeys(r["contender"] for r in rows) if c != "flatshard"]  # in run order
        for j, peer in enumerate(peers):
            pts = sorted(
                (r["num_params"], r["measured_mib_max_rank"])
                for r in rows
                if r["world"] == widest and r["allocator"] == alloc and r["contender"] == peer
            )
            if pts:
                ax.plot(
                    [p[0] / 1e6 for p in pts],
                    [p[1] for p in pts],
                    ":",
                    marker="sD^"[j % 3],
                    color="0.45",
                    label=f"N={widest} {peer} measured",
                )
        ax.set_xlabel("parameters (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        short = {
            "glibc": "glibc malloc defaults (headline)",
            "mmap64k": "MALLOC_MMAP_THRESHOLD_=65536 (diagnostic)",
        }
        ax.set_title(f"{alloc}: {short[alloc]}", fontsize=9)
    axes[0][0].set_ylabel("MiB per rank: peak RSS during training - RSS before model build")
    save_figure(fig, path, title)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "allocator",
        "contender",
        "d_model x layers",
        "params",
        "N",
        "measured MiB/rank",
        "theory MiB",
        "measured/theory",
        "within 15%",
        "shared pages once: MiB/rank, ratio",
        "excess MiB",
        "code pages MiB",
        "setup / params shard MiB",
        "peak at",
        "malloc free kept MiB",
        "trim released MiB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['allocator']} | {r['contender']} | {r['size']} | - | {r['world']} | FAILED: "
                f"{r['error'].strip().splitlines()[-1][:90]} |"
            )
            continue
        cells = [
            r["allocator"],
            r["contender"],
            r["size"],
            f"{r['num_params'] / 1e6:.2f}M",
            str(r["world"]),
            " / ".join(f"{x:.0f}" for x in r["measured_mib_per_rank"]),
            f"{r['theory_mib']:.1f}",
            f"{r['ratio_max_rank']:.2f}",
            "yes" if r["within_tolerance"] else "no",
            f"{max(r['measured_shared_once_mib_per_rank']):.0f}, {r['ratio_shared_once_max_rank']:.2f}"
            + (" (yes)" if r["within_tolerance_shared_once"] else " (no)"),
            f"{r['measured_mib_max_rank'] - r['theory_mib']:+.0f}",
            f"{max(r['file_backed_growth_mib_per_rank']):.0f}",
            f"{r['setup_mib_max_rank']:.0f} / {r['theory_parts_mib']['params_shard']:.0f}",
            r["peak_phase"],
        ]
        if "malloc_at_peak_phase_end_minus_base_mib" in r:
            cells.append(f"{r['malloc_at_peak_phase_end_minus_base_mib']['free_kept']:+.0f}")
            cells.append(f"{max(r['trim_released_mib_per_rank']):.0f}")
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_side_by_side(rows: list[dict[str, Any]], contenders: list[str]) -> str:
    """Per point: every contender's peak (max rank, MiB) and its ratio to theory, then flatshard / each peer."""
    peers = [c for c in contenders if c != "flatshard"]
    head = ["allocator", "d_model x layers", "N", "theory MiB"]
    head += [f"{c} MiB (x theory)" for c in contenders] + [f"flatshard / {c}" for c in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    points: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        points.setdefault((r["allocator"], r["size"], r["world"]), {})[r["contender"]] = r
    for (allocator, size, world), by in points.items():
        ok = {c: r for c, r in by.items() if "error" not in r}
        theory_mib = next((r["theory_mib"] for r in ok.values()), None)
        cells = [allocator, size, str(world), "-" if theory_mib is None else f"{theory_mib:.1f}"]
        for c in contenders:
            r = ok.get(c)
            cells.append(
                "-" if r is None else f"{r['measured_mib_max_rank']:.0f} ({r['ratio_max_rank']:.2f}x)"
            )
        for c in peers:
            mine, theirs = ok.get("flatshard"), ok.get(c)
            cells.append(
                "-"
                if mine is None or theirs is None
                else f"{mine['measured_mib_max_rank'] / theirs['measured_mib_max_rank']:.2f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_theory(rows: list[dict[str, Any]]) -> str:
    head = ["d_model x layers", "N", "params+grads+AdamW shard", "largest unit x2", "activations", "theory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    seen = set()
    for r in rows:
        if "error" in r or (r["size"], r["world"]) in seen:
            continue
        seen.add((r["size"], r["world"]))
        t = r["theory_parts_mib"]
        state = t["params_shard"] + t["grads_shard"] + t["adamw_states"]
        cells = [r["size"], str(r["world"]), f"{state:.1f}", f"{t['largest_unit_unsharded']:.1f}"]
        cells += [f"{t['activations']:.1f}", f"{t['total']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
