"""Tensor parallel x data parallel: flatshard's 2-D sharding against FSDP2 + TP, training then a sharded save.

On a ("data_parallel", "tensor_parallel") mesh (``--mesh DPxTP``, default 2x2 on 4 ranks), both contenders apply
the same sequence-parallel Llama plan (``benchmarks/tp_model.py``) on "tensor_parallel" to the same model from the
same seed, then shard over "data_parallel": ``flatshard_tp`` with ``flatshard.shard(model, device_mesh=mesh)``,
``fsdp2_tp`` with torch's ``fully_shard`` per ``Block`` and the root on ``mesh["data_parallel"]`` (what Lightning's
``ModelParallelStrategy`` expects ``configure_model`` to do; plain torch here, no Trainer). The user's sequence:
``--warmup`` + ``--steps`` AdamW steps (a step is ``barrier -> t0 -> forward -> cross-entropy -> backward ->
optimizer.step() -> zero_grad() -> t1``), one more step with the collectives counted, then a sharded DCP save
(flatshard's ``save_checkpoint(state_dict_type="sharded")``; for FSDP2 ``dcp.save`` of ``get_model_state_dict`` and
``get_optimizer_state_dict``, as ``ModelParallelStrategy`` saves).

Reported: the median step (rank 0, and the slowest rank's), peak RSS per rank during training (``VmHWM`` reset after
setup), the save's time and peak RSS growth, and bytes per step per mesh dimension (rank 0): data-parallel bytes
from flatshard's own per-group counters for ``flatshard_tp`` (its shared-memory transport is invisible to torch's
dispatcher) and from ``benchmarks/comm_bytes.py``'s dispatch mode for ``fsdp2_tp``; tensor-parallel bytes from that
mode for both (DTensor's collectives). The losses of every step must agree within 1e-4 and the saved weights within
1e-3 before anything is compared.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import contenders as reg
from ..comm_bytes import CollectiveBytes
from ..measure import Probe, cpu_s, hwm_mib, median, reset_peak_rss, rss_mib
from ..report import Column, Panel
from ..schema import Row
from ..tp_model import MODEL_FIELDS, build_llama, check_divisible, llama_loss, make_tokens
from ..tp_model import PRESETS as MODEL_PRESETS
from . import check_against, failed, interleaved

PRESETS = ("cpu-small", "tiny")
CONTENDERS = ("flatshard_tp", "fsdp2_tp")
DEFAULT_CONTENDERS = CONTENDERS
REFERENCE = "flatshard_tp"
LOSS_TOL, WEIGHT_TOL = 1e-4, 1e-3
DIMENSIONS = ("data_parallel", "tensor_parallel")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
RATIOS = (
    "step_s",
    "slowest_rank_step_s",
    "cpu_s_per_step",
    "peak_rss_mib",
    "train_rss_increase_mib",
    "save_s",
    "save_peak_growth_mib",
    "dp_mib",
    "tp_mib",
)
COLUMNS = [
    Column("median step s", "step_s", ".4f"),
    Column("slowest rank s", "slowest_rank_step_s", ".4f"),
    Column("CPU s/step r0", "cpu_s_per_step", ".2f"),
    Column("peak RSS MiB/rank", "peak_rss_mib", ".0f"),
    Column("train ΔRSS MiB/rank", "train_rss_increase_mib", ".0f"),
    Column("save s", "save_s", ".3f"),
    Column("save peak growth MiB/rank", "save_peak_growth_mib", ".0f"),
    Column("data-parallel MiB/step", "dp_mib", ".2f"),
    Column("tensor-parallel MiB/step", "tp_mib", ".2f"),
    Column("final loss", "final_loss", ".5f"),
    Column("flatshard ÷ this: time", "÷step_s", ".3f"),
    Column("peak RSS", "÷peak_rss_mib", ".3f"),
    Column("save s", "÷save_s", ".3f"),
    Column("dp bytes", "÷dp_mib", ".3f"),
    Column("tp bytes", "÷tp_mib", ".3f"),
]
PANELS = [
    Panel("median step time, s", ("step_s", "slowest_rank_step_s")),
    Panel("peak RSS per rank, MiB", ("peak_rss_mib",)),
    Panel("MiB per step, rank 0", ("dp_mib", "tp_mib")),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    for name in MODEL_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument("--mesh", default="2x2", help="DPxTP: data-parallel x tensor-parallel ranks (default 2x2)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--folder", default=None, help="where the sharded checkpoints go (default: a temporary one)"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    cfg = dict(MODEL_PRESETS[args.preset])
    overrides = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    cfg.update(overrides, overrides=overrides, preset=args.preset, device="cpu", backend="gloo")
    dp, _, tp = args.mesh.lower().partition("x")
    if not (dp.isdigit() and tp.isdigit()) or int(dp) < 1 or int(tp) < 1:
        raise SystemExit(f"--mesh {args.mesh!r}: give DPxTP, e.g. 2x2 or 1x4")
    mesh = (int(dp), int(tp))
    bad = check_divisible(cfg, mesh[1])
    if bad:
        raise SystemExit(
            f"--mesh {args.mesh}: the plan splits heads, kv heads, the FFN, the vocabulary and the sequence over "
            f"{mesh[1]} tensor-parallel ranks; these do not divide: {', '.join(bad)}. HINT: sizes divisible by "
            f"{mesh[1]}"
        )
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    cfg.update(
        mesh=list(mesh),
        world_size=mesh[0] * mesh[1],
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        seed=args.seed,
        folder=args.folder,
    )
    return cfg, "" if mesh == (2, 2) else f"mesh{mesh[0]}x{mesh[1]}"


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------------


class _FlatshardBytes:
    """flatshard's own count of the bytes this rank sent into its collectives, per mesh dimension (every process
    group the engine keeps a state for, named by its ranks)."""

    def __init__(self, ranks: dict[str, tuple[int, ...]]) -> None:
        self.names = {r: dim for dim, r in ranks.items()}
        self.last = self._read()

    def _read(self) -> dict[tuple[str, str], int]:
        from flatshard.engine.transport import groups

        out: dict[tuple[str, str], int] = {}
        for _, state in groups.live():
            dim = self.names.get(tuple(state.ranks), "other")
            for kind, n in state.sent.items():
                out[(dim, kind)] = out.get((dim, kind), 0) + n
        return out

    def take(self) -> dict[str, dict[str, int]]:
        """``{dimension: {kind: bytes}}`` since the last take."""
        now, out = self._read(), {}  # type: dict[tuple[str, str], int], dict[str, dict[str, int]]
        for (dim, kind), n in now.items():
            if n - self.last.get((dim, kind), 0):
                out.setdefault(dim, {})[kind] = n - self.last.get((dim, kind), 0)
        self.last = now
        return out


def tp_rank(rank: int, world: int, name: str, cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    """Build, plan, shard, train, count one step's collectives, save; this rank's measurements."""
    from torch.distributed.device_mesh import init_device_mesh

    # FSDP2 warns that the root returns a view (the plan's replicated logits); nothing here changes it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    device = reg.rank_device(cfg, rank)
    dp, tp = cfg["mesh"]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=DIMENSIONS)
    dp_rank = mesh["data_parallel"].get_local_rank()
    t_setup = time.perf_counter()
    model = build_llama(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    reg.wrap_tp(name, model, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = cfg["warmup"] + cfg["steps"]
    batches = make_tokens(cfg, dp_rank, dp, n + 1)
    groups = {d: mesh[d].get_group() for d in DIMENSIONS}
    own = None
    if reg.get(name).family == "flatshard":
        own = _FlatshardBytes({d: tuple(dist.get_process_group_ranks(g)) for d, g in groups.items()})

    def step(i: int) -> torch.Tensor:
        loss = llama_loss(model, batches[i])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    gc.collect()
    dist.barrier()
    info: dict[str, Any] = {"setup_s": time.perf_counter() - t_setup, "num_params": num_params}
    info["rss_after_setup_mib"] = rss_mib()
    info["hwm_reset"] = reset_peak_rss()
    times, cpus, own_bytes, losses = [], [], [], []
    for i in range(n):
        dist.barrier()
        if own is not None:
            own.take()
        c0, t0 = cpu_s(), time.perf_counter()
        losses.append(step(i))
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
            cpus.append(cpu_s() - c0)
            if own is not None:
                own_bytes.append(own.take())
    info.update(step_s=times, cpu_s=cpus, peak_rss_mib=hwm_mib())
    info["train_rss_increase_mib"] = info["peak_rss_mib"] - info["rss_after_setup_mib"]
    dist.barrier()
    if own is not None:
        own.take()
    with CollectiveBytes(groups) as seen:  # one more step, untimed: the dispatcher's view of its collectives
        losses.append(step(n))
    info["dispatched_bytes"] = seen.per_dimension()
    info["dispatched_counts"] = {f"{d}.{k}": c for (d, k), c in seen.counts.items()}
    if own is not None:
        info["own_bytes"] = own_bytes
        info["own_bytes_counted_step"] = own.take()
    path = os.path.join(folder, name)
    dist.barrier()
    with Probe() as probe:
        reg.save_sharded_tp(name, model, opt, path)
        dist.barrier()
    info["save"] = probe.result
    stacked = torch.stack(losses).float()
    dist.all_reduce(stacked)
    info["losses"] = [round(v / world, 7) for v in stacked.tolist()]
    info["checkpoint"] = path
    return info


# ----------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------


def _mib_per_step(per_step: list[dict[str, dict[str, int]]], dim: str) -> float:
    return (median([sum(s.get(dim, {}).values()) for s in per_step]) or 0) / 2**20


def summarize(name: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> Row:
    last, world = runs[-1], cfg["world_size"]
    r0 = [median(run[0]["step_s"]) or 0.0 for run in runs]
    slowest = [median([max(ts) for ts in zip(*(r["step_s"] for r in run))]) or 0.0 for run in runs]
    per_rank = lambda f: [round(max(f(run[k]) for run in runs), 1) for k in range(world)]  # noqa: E731
    dispatched = last[0]["dispatched_bytes"]
    metrics: dict[str, Any] = {
        "step_s": median(r0),
        "slowest_rank_step_s": median(slowest),
        "cpu_s_per_step": median([c for run in runs for c in run[0]["cpu_s"]]),
        "peak_rss_mib": per_rank(lambda r: r["peak_rss_mib"]),
        "train_rss_increase_mib": per_rank(lambda r: r["train_rss_increase_mib"]),
        "save_s": median([run[0]["save"]["s"] for run in runs]),
        "save_peak_growth_mib": per_rank(lambda r: r["save"]["peak_growth_mib"]),
        "tp_mib": sum(dispatched.get("tensor_parallel", {}).values()) / 2**20,
        "final_loss": last[0]["losses"][-1],
        "num_params": last[0]["num_params"],
    }
    if "own_bytes" in last[0]:  # flatshard's counters: its data-parallel collectives, whatever the transport
        metrics["dp_mib"] = _mib_per_step(last[0]["own_bytes"], "data_parallel")
        metrics["own_tp_mib"] = _mib_per_step(last[0]["own_bytes"], "tensor_parallel")
        metrics["own_other_mib"] = _mib_per_step(last[0]["own_bytes"], "other")
    else:
        metrics["dp_mib"] = sum(dispatched.get("data_parallel", {}).values()) / 2**20
    for dim in (*DIMENSIONS, "other"):
        for kind, nbytes in dispatched.get(dim, {}).items():
            metrics[f"dispatched_{dim}_{kind}_mib"] = nbytes / 2**20
    return Row(name=name, contender=name, metrics=metrics, runs=runs)


def _losses_close(row: Row, ref: Row) -> str | None:
    a, b = row.runs[-1][0]["losses"], ref.runs[-1][0]["losses"]
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
    row.metrics["loss_diff"] = worst
    return None if worst <= LOSS_TOL else f"losses differ from {ref.name}'s by {worst:.2e} (> {LOSS_TOL:g})"


def saved_weights(path: str) -> dict[str, torch.Tensor]:
    """The model tensors of a sharded DCP directory, whole, by their original names (either layout: flatshard's
    and the ``{"model": ...}`` one of the FSDP2 contender)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "plain.pt"))
        plain = torch.load(os.path.join(tmp, "plain.pt"), weights_only=False)
    model = plain.get("model", plain.get("state_dict"))
    if not isinstance(model, dict):
        raise ValueError(f"{path}: no model state in {sorted(plain)}")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def _compare_saves(rows: list[Row], ref: Row | None) -> None:
    """The rows whose losses agreed: the weights each saved against the reference's, within WEIGHT_TOL."""
    if ref is None or not ref.ok:
        return
    mine = saved_weights(ref.runs[-1][0]["checkpoint"])
    for r in rows:
        if not r.ok or r is ref:
            continue
        theirs = saved_weights(r.runs[-1][0]["checkpoint"])
        why: str | None
        if theirs.keys() != mine.keys():
            why = f"saved keys differ: {sorted(mine.keys() ^ theirs.keys())[:4]}"
        else:
            worst = max((theirs[k].float() - mine[k].float()).abs().max().item() for k in mine)
            r.metrics["saved_weight_diff"] = worst
            why = None if worst <= WEIGHT_TOL else f"saved weights differ by {worst:.2e} (> {WEIGHT_TOL:g})"
        r.check["saved"] = "ok" if why is None else why
        if why:
            r.check.update(ok=False, why=why)
            r.status = "check failed"


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    with tempfile.TemporaryDirectory(dir=cfg["folder"]) as folder:

        def once(c: str) -> Any:  # a fresh directory per run: no save overwrites an earlier one
            return reg.run_ranks(tp_rank, cfg["world_size"], c, cfg, tempfile.mkdtemp(dir=folder), cfg=cfg)

        runs, errors = interleaved(contenders, cfg["repeats"], once)
        rows = [failed(c, errors[c]) if c in errors else summarize(c, runs[c], cfg) for c in contenders]
        ok = [r for r in rows if r.ok]
        reference = next((r for r in ok if r.name == REFERENCE), ok[0] if ok else None)
        check_against(rows, reference, _losses_close)
        _compare_saves(rows, reference)
    dp, tp = cfg["mesh"]
    notes = [
        f"mesh {dp} x {tp} (data_parallel x tensor_parallel), gloo; the same sequence-parallel Llama plan for "
        "both; fsdp2_tp is plain torch fully_shard on the data-parallel mesh, as Lightning's ModelParallelStrategy "
        "runs it (no Trainer)",
        "bytes: rank 0's per step, a collective's input; data-parallel: flatshard's per-group counters "
        "(flatshard_tp: it moves CPU tensors through shared memory, not gloo) or the dispatch mode (fsdp2_tp); "
        "tensor-parallel: the dispatch mode for both (one step after the timed ones)",
        f"checks: every step's loss within {LOSS_TOL:g} of flatshard_tp's, the saved weights within {WEIGHT_TOL:g}",
    ]
    tps = {r.name: round(r.metrics["tp_mib"], 6) for r in rows if r.ok}
    if len(set(tps.values())) > 1:
        notes.append(f"tensor-parallel bytes differ between contenders: {tps} (MiB per step)")
    if any(r.ok and not all(x["hwm_reset"] for x in r.runs[-1]) for r in rows):
        notes.append("VmHWM could not be reset: peak RSS is the process-lifetime peak")
    return rows, notes


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    return [("flatshard_tp", "fsdp2_tp")]
