"""step_time.py's report: ratios between contenders, MFU on CUDA, the Markdown table and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from bench_contenders import FLATSHARD_CONTENDERS
from bench_output import failed_row, fmt, markdown_table, pyplot, save_figure

__all__ = ["compute_ratios", "format_ratios", "format_table", "model_flops_utilization", "plot"]


def model_flops_utilization(
    tokens_per_s: float | None, num_params: int, cfg: dict[str, Any], world_size: int
) -> dict[str, Any]:
    """MFU by torchtitan's formula: ``6 * N + 12 * n_layer * d_model * seq_len`` FLOPs per token, with ``N``
    the parameters that take part in matrix products: ``num_params`` (the tied token embedding counted once,
    as the output head) less the position embedding (``seq_len * d_model``, a lookup). Against the card's
    dense bf16 peak, per GPU in use (ranks sharing a GPU under gloo count it once)."""
    d, n_layer, seq = cfg["d_model"], cfg["n_layer"], cfg["seq_len"]
    numel = num_params - seq * d
    flop_per_token = 6 * numel + 12 * n_layer * d * seq
    gpus = min(world_size, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    peak = peak_bf16_flops(torch.cuda.get_device_name(0)) if gpus else None
    out: dict[str, Any] = {"flop_per_token": flop_per_token, "peak_bf16_flops_per_gpu": peak}
    if peak and tokens_per_s:
        out["mfu"] = tokens_per_s * flop_per_token / (peak * gpus)
    return out


def peak_bf16_flops(name: str) -> float | None:
    """Dense bf16 tensor-core peak of a GPU by name (torchtitan's table for the cards it knows)."""
    table = (
        ("A100", 312e12),
        ("H100 NVL", 835e12),
        ("H100 PCIe", 756e12),
        ("H100", 989e12),  # SXM
        ("H200", 989e12),
        ("H20", 148e12),
        ("B200", 2.25e15),
        ("L40S", 362e12),
    )
    for key, peak in table:
        if key in name:
            return peak
    return None


def compute_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """flatshard variant / peer for step time and peak memory (< 1: flatshard is faster / smaller)."""
    ratios: dict[str, dict[str, Any]] = {}
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    for fs in FLATSHARD_CONTENDERS:
        if fs not in ok:
            continue
        for peer, r in ok.items():
            if peer == fs:
                continue
            entry: dict[str, Any] = {
                "step_time_ratio": ok[fs]["median_step_s"] / r["median_step_s"],
                "min_step_time_ratio": ok[fs]["min_step_s"] / r["min_step_s"],
                "peak_rss_ratio": max(ok[fs]["peak_rss_train_mib_per_rank"])
                / max(r["peak_rss_train_mib_per_rank"]),
                "peak_rss_increase_ratio": _safe_ratio(
                    max(ok[fs]["peak_rss_increase_mib_per_rank"]), max(r["peak_rss_increase_mib_per_rank"])
                ),
            }
            if "cuda_max_allocated_mib_per_rank" in r:
                entry["cuda_max_allocated_ratio"] = max(ok[fs]["cuda_max_allocated_mib_per_rank"]) / max(
                    r["cuda_max_allocated_mib_per_rank"]
                )
            ratios[f"{fs}/{peer}"] = entry
    return ratios


def _safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def format_table(results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], cuda: bool) -> str:
    ref = "flatshard" if results.get("flatshard", {}).get("status") == "ok" else None
    headers = [
        "contender",
        "median step s",
        "min step s",
        "slowest-rank s",
        "tokens/s",
        "sys/user CPU s r0",
        "peak RSS MiB/rank",
        "train ΔRSS MiB/rank",
    ]
    polled = any("private_peak_mib_per_rank" in r for r in results.values())
    if polled:
        headers += ["private peak MiB/rank", "node peak MiB (shared once)"]
    if cuda:
        headers += ["max alloc MiB/rank", "alloc retries", "MFU"]
    mem_key = "cuda_max_allocated_ratio" if cuda else "peak_rss_ratio"
    headers += ["final loss", "flatshard/this time", "flatshard/this " + ("max alloc" if cuda else "RSS")]
    rows = []
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append(failed_row(name, r))
            continue
        row = [
            name,
            fmt(r["median_step_s"], ".4f"),
            fmt(r["min_step_s"], ".4f"),
            fmt(r["median_of_slowest_rank_step_s"], ".4f"),
            fmt(r["tokens_per_s"], ".0f"),
            f"{r['train_sys_s_per_rank'][0]:.1f} / {r['train_user_s_per_rank'][0]:.1f}",
            " / ".join(fmt(x, ".0f") for x in r["peak_rss_train_mib_per_rank"]),
            " / ".join(fmt(x, ".0f") for x in r["peak_rss_increase_mib_per_rank"]),
        ]
        if polled:
            row += [
                " / ".join(fmt(x, ".0f") for x in r.get("private_peak_mib_per_rank", [])),
                fmt(r.get("node_peak_mib"), ".0f"),
            ]
        if cuda:
            row += [
                " / ".join(fmt(x, ".0f") for x in r["cuda_max_allocated_mib_per_rank"]),
                " / ".join(str(x) for x in r["cuda_num_alloc_retries_per_rank"]),
                fmt(r.get("mfu"), ".1%"),
            ]
        rat = ratios.get(f"{ref}/{name}") if ref else None
        row += [
            fmt(r["final_loss"], ".5f"),
            "1 (ref)" if name == ref else fmt(rat and rat["step_time_ratio"], ".3f"),
            "1 (ref)" if name == ref else fmt(rat and rat.get(mem_key), ".3f"),
        ]
        rows.append(row)
    return markdown_table(headers, rows)


def format_ratios(ratios: dict[str, dict[str, Any]]) -> str:
    lines = []
    for key, r in ratios.items():
        extra = ""
        if "cuda_max_allocated_ratio" in r:
            extra = f", max_allocated x{r['cuda_max_allocated_ratio']:.2f}"
        lines.append(
            f"  {key:<32} step time x{r['step_time_ratio']:.2f} (min x{r['min_step_time_ratio']:.2f}), "
            f"peak RSS x{r['peak_rss_ratio']:.2f}, "
            f"training RSS increase x{fmt(r['peak_rss_increase_ratio'], '.2f')}{extra}"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], cfg: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    names = list(ok)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(names) + 4), 4.5))
    x = list(range(len(names)))
    if names:
        width = 0.38
        med = [ok[n]["median_step_s"] for n in names]
        slow = [ok[n]["median_of_slowest_rank_step_s"] for n in names]
        colors = ["tab:blue" if n.startswith("flatshard") else "tab:gray" for n in names]
        ax_t.bar([i - width / 2 for i in x], med, width, color=colors, label="rank 0 median")
        ax_t.bar(
            [i + width / 2 for i in x], slow, width, color=colors, alpha=0.5, label="slowest-rank median"
        )
        for i, v in enumerate(med):
            ax_t.annotate(f"{v:.3f}", (i - width / 2, v), ha="center", va="bottom", fontsize=7)
        ws = len(ok[names[0]]["peak_rss_train_mib_per_rank"])
        w = 0.8 / (2 * ws)
        for rank in range(ws):
            peak = [ok[n]["peak_rss_train_mib_per_rank"][rank] or 0 for n in names]
            base = [ok[n]["rss_after_setup_mib_per_rank"][rank] or 0 for n in names]
            off = (2 * rank - ws) * w + w / 2
            color = f"C{rank}"
            ax_m.bar([i + off for i in x], peak, w, color=color, label=f"rank {rank} peak during training")
            ax_m.bar(
                [i + off + w for i in x],
                base,
                w,
                color=color,
                alpha=0.4,
                label=f"rank {rank} RSS after setup",
            )
        if cfg["device"] == "cuda":
            alloc = [max(ok[n]["cuda_max_allocated_mib_per_rank"]) for n in names]
            ax_m.plot(x, alloc, "k^", label="CUDA max allocated (max rank)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        ax.grid(axis="y", alpha=0.3)
    ax_t.set_ylabel("step time (s), lower is better")
    ax_t.set_title("median step time")
    ax_m.set_ylabel("MiB")
    ax_m.set_title("peak RSS per rank" + (" (and CUDA peak)" if cfg["device"] == "cuda" else ""))
    failed = [k for k, v in results.items() if v.get("status") != "ok"]
    if failed:
        title += f"  [failed: {', '.join(failed)}]"
    save_figure(fig, path, title)
