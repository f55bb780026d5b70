"""The estimate as a table: one column per world size (and shard group size), one line per quantity."""

from __future__ import annotations

from collections.abc import Callable

from flatshard.estimator.api import Estimate, RankEstimate, format_bytes

__all__ = ["format_bytes", "format_count", "format_seconds", "format_table"]


def format_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _column(r: RankEstimate) -> str:
    if r.tensor_parallel_size > 1:
        return f"{r.world_size} ({r.world_size // r.tensor_parallel_size} dp x {r.tensor_parallel_size} tp)"
    if r.shard_group_size is None:
        return f"{r.world_size} ranks"
    return f"{r.world_size} ({r.world_size // r.shard_group_size}x{r.shard_group_size})"


def _comm_of(kind: str) -> Callable[[RankEstimate], str]:
    def value(r: RankEstimate) -> str:
        return format_bytes(r.comm.get(kind, 0))

    return value


def format_table(est: Estimate) -> str:
    rows = est.rows
    opts = est.options
    lines: list[tuple[str, list[str]]] = []

    def add(label: str, value: Callable[[RankEstimate], str], when: bool = True) -> None:
        if when:
            lines.append((label, [value(r) for r in rows]))

    def section(title: str) -> None:
        lines.append((title, []))

    any_offload = any(r.host for r in rows)
    add("units (flat parameters)", lambda r: str(r.units))
    add("largest unit", lambda r: f"{r.largest_unit} ({format_count(r.largest_unit_numel)})")
    section("memory per rank")
    add("  parameters", lambda r: format_bytes(r.params) + (" (host)" if r.offload is True else ""))
    add("  gradients", lambda r: format_bytes(r.grads))
    add("  optimizer state", lambda r: format_bytes(r.optimizer) + (" (host)" if r.offload else ""))
    add("  buffers", lambda r: format_bytes(r.buffers), any(r.buffers for r in rows))
    add("  gathered units (max)", lambda r: format_bytes(r.gathered))
    add("  allocator lag (CUDA)", lambda r: format_bytes(r.allocator_lag), opts.get("device") == "cuda")
    add("  activations", lambda r: format_bytes(r.activations) if r.activations is not None else "not given")
    moved = any(r.activations_host for r in rows)
    add("  activations (host)", lambda r: format_bytes(r.activations_host), moved)
    add("  other transient", lambda r: format_bytes(r.other_transient))
    add("  overhead", lambda r: format_bytes(r.overhead), any(r.overhead for r in rows))
    add("  runtime (measured)", lambda r: format_bytes(r.runtime), any(r.runtime_parts for r in rows))
    add("  peak", lambda r: format_bytes(r.peak))
    add("  host memory (offload)", lambda r: format_bytes(r.host), any_offload)
    if rows and rows[0].capacity is not None:
        add(f"  fits in {format_bytes(rows[0].capacity)}", lambda r: "yes" if r.fits else "NO")
    section("communication per rank per step (bytes into collectives, as comm_stats counts them)")
    order = ("all_gather", "reduce_scatter", "all_reduce")
    kinds = sorted(
        {k for r in rows for k in r.comm}, key=lambda k: order.index(k) if k in order else len(order)
    )
    names = {
        "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter",
        "all_reduce": "all-reduce (replicas)",
    }
    for kind in kinds:
        add(f"  {names.get(kind, kind)}", _comm_of(kind))
    tp_kinds = sorted(
        {k for r in rows for k in r.tensor_parallel_comm},
        key=lambda k: order.index(k) if k in order else len(order),
    )
    for kind in tp_kinds:

        def tp_of(r: RankEstimate, kind: str = kind) -> str:
            return format_bytes(r.tensor_parallel_comm.get(kind, 0))

        add(f"  tensor-parallel {kind.replace('_', '-')}", tp_of)
    add(
        "  optimizer exchange (Muon)",
        lambda r: format_bytes(r.optimizer_exchange),
        any(r.optimizer_exchange for r in rows),
    )
    add(
        "  total",
        lambda r: format_bytes(
            sum(r.comm.values()) + sum(r.tensor_parallel_comm.values()) + r.optimizer_exchange
        ),
    )
    add("  sent on the links (ring)", lambda r: format_bytes(r.wire))
    roles = ("shard", "replicate", "node", "tensor_parallel")
    groups = [g for g in roles if any(g in r.comm_by_group for r in rows)]
    if len(groups) > 1:
        for g in groups:

            def into(r: RankEstimate, g: str = g) -> str:
                return format_bytes(r.comm_by_group.get(g, 0))

            add(f"  into the {g} group", into)
    if rows:
        micro = rows[0].micro_batches
        add(
            f"  between nodes per optimizer step ({micro} micro-batch{'es' if micro != 1 else ''})",
            lambda r: format_bytes(r.cross_node) + f" ({r.ranks_per_node}/node)",
        )
    if any(r.communication_s is not None for r in rows):
        link = opts.get("link") or {}
        title = f"time per step ({link.get('name')}: {link.get('bandwidth', 0) / 1e9:.1f} GB/s, "
        title += f"{link.get('latency', 0) * 1e6:.0f} us; {opts.get('tflops')} TFLOP/s)"
        section(title)
        add("  compute", lambda r: format_seconds(r.compute_s))
        add("  communication", lambda r: format_seconds(r.communication_s))
        add("  exposed communication", lambda r: format_seconds(r.exposed_s))
        add("  step", lambda r: format_seconds(r.step_s))
    width = max(len(label) for label, values in lines if values) + 2
    cols = [max(len(_column(r)), *(len(v[i]) for _, v in lines if v)) + 2 for i, r in enumerate(rows)]
    header = (
        f"flatshard estimate: {est.target} | {opts.get('sharding_strategy')}, {opts.get('mixed_precision')}, "
        f"optimizer {opts.get('optimizer')}, device {opts.get('device')}"
    )
    out = [header, " " * width + "".join(_column(r).rjust(c) for r, c in zip(rows, cols, strict=True))]
    for label, values in lines:
        out.append(
            label.ljust(width) + "".join(v.rjust(c) for v, c in zip(values, cols, strict=True))
            if values
            else label
        )
    notes = sorted({n for r in rows for n in r.notes})
    out += [f"note: {n}" for n in notes]
    for r in rows:
        if r.runtime_parts:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in r.runtime_parts.items())
            out.append(f"runtime at {_column(r)}: {parts}")
    return "\n".join(out)
