"""Training steps: time, memory and bytes per collective of flatshard and its peers, side by side.

Every contender trains the same GPT from the same seed on the same batches, in fresh ranks of its own. A step is
``barrier -> t0 -> forward -> cross-entropy -> backward -> optimizer.step() -> zero_grad() -> t1`` (``--micro-batches
M``: M forward/backward pairs, the loss divided by M; ``flatshard_no_sync``, ``flatshard_hybrid_no_sync`` and DDP
keep all but the last out of the reduction). ``--ranks-per-node R`` plays nodes of R ranks: bytes per process group
split into intra-node and cross-node, and a modelled step time with the cross-node bytes over a link of
``--cross-node-gbps`` (``benchmarks/nodes.py``). Losses are checked against DDP's (else the first contender's)
before anything is compared; rows that train in float8 (``--float8``, the ``*_float8`` contenders) against the
first float8 row (DDP's if it has one).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import contenders as reg
from .. import nodes
from ..measure import (
    MemoryPoller,
    cpu_s,
    hwm_mib,
    median,
    reset_peak_rss,
    rss_mib,
    shared_pages_counted_twice_mib,
    shmem_kib,
)
from ..model import add_lora, build_model, local_numel, make_batches
from ..report import Column, Panel
from ..schema import Row
from . import add_gpt_arguments, check_against, failed, gpt_config, interleaved

PRESETS = ("cpu-small", "cpu-large", "cuda-1b", "tiny")
CONTENDERS = tuple(
    n
    for n, c in reg.REGISTRY.items()
    if c.family in ("flatshard", "fsdp1", "fsdp2", "ddp") and not c.options.get("tensor_parallel")
)
DEFAULT_CONTENDERS = ("flatshard", "fsdp1", "fsdp2", "ddp", "flatshard_grad_op")
RATIOS = (
    "step_s",
    "peak_rss_mib",
    "cuda_max_allocated_mib",
    "reduce_mib",
    "cross_group_mib",
    "intra_node_mib",
    "cross_node_mib",
    "cross_node_link_mib",
    "modelled_step_s",
)
COLUMNS = [
    Column("median step s", "step_s", ".4f"),
    Column("slowest rank s", "slowest_rank_step_s", ".4f"),
    Column("tokens/s", "tokens_per_s", ".0f"),
    Column("CPU s/step r0", "cpu_s_per_step", ".2f"),
    Column("peak RSS MiB/rank", "peak_rss_mib", ".0f"),
    Column("train ΔRSS MiB/rank", "train_rss_increase_mib", ".0f"),
    Column("final loss", "final_loss", ".5f"),
    Column("flatshard ÷ this: time", "÷step_s", ".3f"),
    Column("peak RSS", "÷peak_rss_mib", ".3f"),
]
OPTIONAL = [  # shown when a row has them (the options that measure them were given)
    Column("all-gather MiB/step", "all_gather_mib", ".1f"),
    Column("reduce MiB/step", "reduce_mib", ".1f"),
    Column("across groups MiB/step", "cross_group_mib", ".1f"),
    Column("saved activations MiB", "saved_activations_mib", ".1f"),
    Column("held after forward MiB", "held_activations_mib", ".1f"),
    Column("private peak MiB/rank", "private_peak_mib", ".0f"),
    Column("node peak MiB", "node_peak_mib", ".0f"),
    Column("all-gather overlapped %/rank", "all_gather_overlapped_pct", ".0f"),
    Column("all-gather blocked ms/rank", "all_gather_blocked_ms", ".1f"),
    Column("reduce-scatter overlapped %/rank", "reduce_scatter_overlapped_pct", ".0f"),
    Column("reduce-scatter blocked ms/rank", "reduce_scatter_blocked_ms", ".1f"),
    Column("max allocated MiB/rank", "cuda_max_allocated_mib", ".0f"),
    Column("alloc retries", "cuda_alloc_retries", "d"),
    Column("MFU", "mfu", ".1%"),
]
PANELS = [
    Panel("median step time, s", ("step_s", "slowest_rank_step_s")),
    Panel("peak RSS per rank, MiB", ("peak_rss_mib",)),
]
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# --ranks-per-node: the table of cross-node traffic (per-rank memory stays in the JSON: 8 ranks make wide cells)
NODE_COLUMNS = [
    Column("median step s", "step_s", ".4f"),
    Column("slowest rank s", "slowest_rank_step_s", ".4f"),
    Column("CPU s/step r0", "cpu_s_per_step", ".2f"),
    Column("intra-node MiB/step", "intra_node_mib", ".2f"),
    Column("cross-node MiB/step", "cross_node_mib", ".2f"),
    Column("cross-node all-gather fwd", "cross_node_all_gather_forward_mib", ".2f"),
    Column("all-gather bwd", "cross_node_all_gather_backward_mib", ".2f"),
    Column("reduce-scatter", "cross_node_reduce_scatter_mib", ".2f"),
    Column("all-reduce", "cross_node_all_reduce_mib", ".2f"),
    Column("link MiB/step (model)", "cross_node_link_mib", ".2f"),
    Column("link s (model)", "link_s", ".4f"),
    Column("modelled step s", "modelled_step_s", ".4f"),
    Column("final loss", "final_loss", ".5f"),
    Column("flatshard ÷ this: time", "÷step_s", ".3f"),
    Column("modelled time", "÷modelled_step_s", ".3f"),
    Column("this ÷ flatshard: cross-node bytes", "/cross_node_mib", ".3f"),
]


def columns(rows: list[Row]) -> list[Column]:
    if any("cross_node_mib" in r.metrics for r in rows if r.ok):
        return NODE_COLUMNS
    hybrid = any(reg.get(r.contender).options.get("strategy", "").startswith("HYBRID") for r in rows)
    present = [c for c in OPTIONAL if any(c.key in r.metrics for r in rows if r.ok)]
    return COLUMNS[:-3] + [c for c in present if hybrid or c.key != "cross_group_mib"] + COLUMNS[-3:]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_gpt_arguments(p, steps=10, warmup=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the preset's")
    p.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on CUDA, else gloo"
    )
    p.add_argument(
        "--precision", choices=["fp32", "bf16-mixed"], default=None, help="default: bf16-mixed on CUDA"
    )
    p.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="gradient accumulation: micro-batches per step (default 1; 4 with --ranks-per-node)",
    )
    p.add_argument(
        "--optimizer", choices=["adamw", "muon"], default="adamw", help="muon: Muon on the blocks' matrices"
    )
    p.add_argument("--lora", type=int, default=0, metavar="R", help="freeze the model, train rank-R adapters")
    p.add_argument(
        "--base-dtype", choices=["fp32", "bf16"], default="fp32", help="with --lora: the base's dtype"
    )
    p.add_argument(
        "--compile-backend", default="inductor", help="the *_compiled contenders' torch.compile backend"
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="every contender trains with torchao's tensorwise float8 recipe (float8 all-gathers where sharded)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="one device's dense peak, for MFU (default on CUDA: the GPU's bf16 peak; on CPU: no MFU)",
    )
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        help="the hybrid contenders' shard group (default: --ranks-per-node, else 2)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        metavar="R",
        help="play nodes of R ranks (node = rank // R): bytes per step intra-node and cross-node, a modelled "
        "step time; flatshard_node_copy keeps its copy over a node",
    )
    p.add_argument(
        "--cross-node-gbps",
        type=float,
        default=25.0,
        help="with --ranks-per-node: the modelled cross-node bandwidth per rank, Gbit/s (default 25: a "
        "200 Gbit/s card shared by 8 GPUs)",
    )
    p.add_argument("--poll-memory", action="store_true", help="private and node memory, sampled every 5 ms")
    p.add_argument(
        "--timeline", action="store_true", help="flatshard: how much communication hides behind compute"
    )
    p.add_argument(
        "--count-activations",
        action="store_true",
        help="flatshard: bytes autograd saves in a forward, and all the forward leaves alive for backward",
    )
    p.add_argument(
        "--malloc-mmap-threshold", type=int, default=None, help="MALLOC_MMAP_THRESHOLD_ for the ranks"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    cfg = gpt_config(args)
    cfg["device"] = args.device or cfg["device"]
    cuda = cfg["device"] == "cuda"
    if cuda and args.world_size is None:
        cfg["world_size"] = torch.cuda.device_count()
    rpn = _ranks_per_node(args, cfg)
    micro_batches = args.micro_batches or (4 if rpn else 1)
    cfg.update(
        backend=args.backend or ("nccl" if cuda else "gloo"),
        precision=args.precision or ("bf16-mixed" if cuda else "fp32"),
        reduce_dtype=args.reduce_dtype,
        micro_batches=micro_batches,
        optimizer=args.optimizer,
        lora=args.lora,
        base_dtype=args.base_dtype,
        compile_kwargs={"backend": args.compile_backend},
        shard_group_size=args.shard_group_size or rpn or 2,
        ranks_per_node=rpn,
        cross_node_gbps=args.cross_node_gbps,
        poll_memory=args.poll_memory,
        timeline=args.timeline,
        count_activations=args.count_activations,
        malloc_mmap_threshold=args.malloc_mmap_threshold,
        float8=args.float8,
        peak_tflops=args.peak_tflops,
    )
    _check_float8(args, cfg)
    if cuda and (
        not torch.cuda.is_available()
        or (cfg["backend"] == "nccl" and torch.cuda.device_count() < cfg["world_size"])
    ):
        raise SystemExit(
            f"--device cuda over {cfg['backend']} needs a GPU per rank. HINT: --backend gloo shares GPUs"
        )
    if args.base_dtype != "fp32" and not args.lora:
        raise SystemExit("--base-dtype is the frozen base's dtype of a fine-tune. HINT: give --lora R too")
    parts = [f"lora{args.lora}" if args.lora else "", "bf16base" if args.base_dtype == "bf16" else ""]
    parts += [
        "muon" if args.optimizer == "muon" else "",
        f"m{micro_batches}" if micro_batches > 1 else "",
    ]
    parts += [f"w{cfg['world_size']}" if args.world_size and not cuda and args.world_size != 2 else ""]
    parts += [f"nodes{cfg['world_size'] // rpn}x{rpn}" if rpn else ""]
    parts += [f"mmap{args.malloc_mmap_threshold // 1024}k" if args.malloc_mmap_threshold else ""]
    parts += ["float8" if args.float8 else ""]
    return cfg, "_".join(p for p in parts if p)


def _ranks_per_node(args: argparse.Namespace, cfg: dict[str, Any]) -> int | None:
    """``--ranks-per-node``, checked against the world size; refuse ``flatshard_node_copy`` without it."""
    rpn, world = args.ranks_per_node, cfg["world_size"]
    names = [c.strip() for c in args.contenders.split(",")]
    if rpn is None:
        if any(reg.get(c).options.get("node_copy") for c in names if c in reg.REGISTRY):
            raise SystemExit(
                "flatshard_node_copy keeps its backward copy over a node. HINT: give --ranks-per-node R"
            )
        return None
    if rpn < 1 or world % rpn or world == rpn:
        raise SystemExit(
            f"--ranks-per-node {rpn} with --world-size {world}: the ranks must make at least 2 nodes of "
            f"{rpn}. HINT: a --world-size that is a multiple of R and at least 2 R (e.g. {2 * max(rpn, 1)})"
        )
    if args.cross_node_gbps <= 0:
        raise SystemExit(f"--cross-node-gbps {args.cross_node_gbps}: a bandwidth must be positive")
    return int(rpn)


def _check_float8(args: argparse.Namespace, cfg: dict[str, Any]) -> None:
    """Refuse what float8 training cannot run, before any rank starts."""
    names = [c.strip() for c in args.contenders.split(",") if c.strip() in reg.REGISTRY]
    converted = [c for c in names if reg.float8(c, cfg)]
    if not converted:
        return
    if args.lora:
        raise SystemExit(
            f"float8 ({', '.join(converted)}) with --lora: this benchmark measures float8 training of the whole "
            "model, not a frozen base with adapters. HINT: drop --lora or the float8 contenders"
        )
    if importlib.util.find_spec("torchao") is None:
        raise SystemExit(f"float8 ({', '.join(converted)}) needs torchao. HINT: pip install torchao")


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks (memory.py runs these too)
# ----------------------------------------------------------------------------------------------------------


def _optimizer(name: str, model: torch.nn.Module, cfg: dict[str, Any]) -> Any:
    """AdamW(lr=1e-4) over the trainable parameters; ``muon``: torch's Muon on the blocks' matrices and AdamW on
    the rest, as Muon's recipes split them (flatshard hands Muon whole matrices; FSDP1/2 1-D pieces)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW([p for _, p in trainable], lr=1e-4)
    context: Any = contextlib.nullcontext()
    if reg.get(name).family == "flatshard":
        import flatshard

        context = flatshard.original_shapes(model)  # Muon checks p.ndim == 2 when it is built
    with context:
        hidden = [p for n, p in trainable if p.ndim == 2 and ".blocks." in f".{n}"]
        rest = [p for n, p in trainable if not (p.ndim == 2 and ".blocks." in f".{n}")]
        return _Optimizers([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-4)])


class _Optimizers:
    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _warm_up(cfg: dict[str, Any]) -> None:
    """Before a baseline: what any training process pays once whatever the model (an AdamW step imports
    ``torch._dynamo``; one plain step of a tiny GPT touches the kernels' code pages)."""
    tiny = build_model(dict(cfg, d_model=64, n_layer=1, n_head=1))
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"]))
    F.cross_entropy(tiny(idx).view(-1, cfg["vocab_size"]), idx.view(-1)).backward()
    opt.step()


def train_rank(rank: int, world: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build, wrap, train; this rank's measurements."""
    from flatshard.engine.transport import comm

    device = reg.rank_device(cfg, rank)
    flatshard_family = reg.get(name).family == "flatshard"
    info: dict[str, Any] = {}
    if cfg.get("baseline_before_build"):  # memory.py: everything the model costs is measured from here
        _warm_up(cfg)
        gc.collect()
        dist.barrier()
        info["base_rss_mib"] = rss_mib()
    pids: list[Any] = [None] * world
    if cfg["poll_memory"]:
        dist.all_gather_object(pids, os.getpid())
        shmem_base = shmem_kib()  # before the model: the transport's segments count in the node total
    t_setup = time.perf_counter()
    model = build_model(cfg)
    if cfg["lora"]:
        if cfg["base_dtype"] == "bf16":  # the base in bf16, the adapters fp32, as peft builds them
            model = model.to(torch.bfloat16)
        torch.manual_seed(cfg["seed"] + 1)
        info["trainable_params"] = add_lora(model, cfg["lora"])
    info["num_params"] = sum(p.numel() for p in model.parameters())
    model = reg.wrap(name, model, cfg, device)
    info["local_numel"] = local_numel(model)
    if flatshard_family and cfg.get("unit_sizes"):  # memory.py's theory: this rank's shard, the largest unit
        from flatshard.engine import unit_states

        layouts = [h.layout for s in unit_states(model) for h in s.handles]
        info["shard_numel"] = sum(lay.shard_numel for lay in layouts)
        info["largest_unit_numel"] = max(lay.padded_numel for lay in layouts)
    opt = _optimizer(name, model, cfg)
    m, vocab = cfg["micro_batches"], cfg["vocab_size"]
    batches = make_batches(cfg, rank, world, device, (cfg["warmup"] + cfg["steps"]) * m)
    mixed = cfg["precision"] == "bf16-mixed"

    def loss_of(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            return F.cross_entropy(model(idx).float().view(-1, vocab), tgt.view(-1))

    # --ranks-per-node: flatshard's bytes per process group, by phase (DDP, FSDP1/2 count none)
    by_group = (
        nodes.GroupBytes(rank, cfg["ranks_per_node"])
        if cfg.get("ranks_per_node") and flatshard_family
        else None
    )

    def mark(phase: str) -> None:
        if by_group is not None:
            by_group.mark(phase)

    def step(i: int) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for k in range(m):
            with reg.accumulating(name, model) if k < m - 1 else contextlib.nullcontext():
                loss = loss_of(*batches[i * m + k]) / m
                mark("forward")
                loss.backward()
                mark("backward")
            total += loss.detach()
        opt.step()
        reg.after_optimizer_step(name, model, cfg)
        mark("step")
        opt.zero_grad(set_to_none=True)
        return total

    gc.collect()
    reg.barrier(device)
    info["setup_s"] = time.perf_counter() - t_setup
    info["rss_after_setup_mib"] = rss_mib()
    info["hwm_reset"] = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    poller = MemoryPoller(pids, shmem_base) if cfg["poll_memory"] and rank == 0 else contextlib.nullcontext()
    times, cpus, comms, overlaps, losses, node_bytes = [], [], [], [], [], []
    with poller:
        for i in range(cfg["warmup"] + cfg["steps"]):
            timed = i >= cfg["warmup"]
            reg.barrier(device)
            comm.comm_stats.clear()
            if by_group is not None:
                by_group.mark("step")  # the barrier's bytes, if any, belong to no step
                by_group.take()
            c0, t0 = cpu_s(), time.perf_counter()
            with comm.timeline() if timed and cfg["timeline"] else contextlib.nullcontext([]) as records:
                t0_ns = time.perf_counter_ns()
                losses.append(step(i))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t1_ns = time.perf_counter_ns()
            if timed:
                times.append(time.perf_counter() - t0)
                cpus.append(cpu_s() - c0)
                comms.append(dict(comm.comm_stats))
                if by_group is not None:
                    node_bytes.append(by_group.take())
                if records:
                    overlaps.append(_overlap(records, t1_ns - t0_ns))
    info.update(step_s=times, cpu_s=cpus, comm_bytes=comms, overlap=overlaps, peak_rss_mib=hwm_mib())
    if by_group is not None:
        info["node_bytes"] = node_bytes
    info["train_rss_increase_mib"] = info["peak_rss_mib"] - info["rss_after_setup_mib"]
    info["shared_pages_twice_mib"] = shared_pages_counted_twice_mib()
    if isinstance(poller, MemoryPoller):
        info["memory_poll"] = poller.result()
    if device.type == "cuda":
        info["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        info["cuda_alloc_retries"] = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        info["cuda_phase_peaks_mib"] = _phase_peaks(loss_of, batches[-1], opt, device)
    if cfg["count_activations"] and flatshard_family:  # after the timed steps: it cannot change them
        from flatshard.testing.activations import held_activation_bytes, saved_activation_bytes

        info["saved_activations_mib"] = saved_activation_bytes(model, lambda: loss_of(*batches[0]))[0] / 2**20
        # selective checkpointing keeps outputs where no saved-tensor hook sees them: count what stays alive
        info["held_activations_mib"] = held_activation_bytes(model, lambda: loss_of(*batches[0]))[0] / 2**20
    stacked = torch.stack(losses).float()
    dist.all_reduce(stacked)
    info["losses"] = [round(v / world, 6) for v in stacked.cpu().tolist()]
    return info


def _overlap(records: list[Any], step_ns: int) -> dict[str, float]:
    """Per collective kind: ms on the transport's worker, ms the training thread blocked in ``wait()`` for it,
    and the share of the worker's time during which the training thread was not blocked (overlapped)."""
    blocked = sorted(w for r in records for w in r.waited)
    out: dict[str, float] = {"step_ms": step_ns / 1e6}
    for kind in KINDS:
        mine = [r for r in records if r.kind == kind and r.busy]
        busy = sum(b - a for r in mine for a, b in [r.busy])
        hidden = busy - sum(
            max(0, min(b, y) - max(a, x)) for r in mine for a, b in [r.busy] for x, y in blocked
        )
        if mine:
            out[f"{kind}_transport_ms"] = busy / 1e6
            out[f"{kind}_blocked_ms"] = sum(y - x for r in mine for x, y in r.waited) / 1e6
            out[f"{kind}_overlapped_pct"] = 100 * hidden / busy if busy else 0.0
    return out


def _phase_peaks(loss_of: Any, batch: Any, opt: Any, device: torch.device) -> dict[str, float]:
    """One more step after the timed ones, the allocator's peak read per phase: where peak memory comes from."""
    out: dict[str, float] = {}

    def phase(name: str, fn: Any) -> Any:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        out[name] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        return result

    loss = phase("forward", lambda: loss_of(*batch))
    phase("backward", loss.backward)
    del loss
    phase("optimizer_step", opt.step)
    phase("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    return out


# ----------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------


def summarize(name: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> Row:
    """The median over repeats of rank 0's median step, the slowest rank's pace, memory per rank (largest over
    repeats), bytes per collective per step (rank 0), and what the options add."""
    last, world = runs[-1], cfg["world_size"]
    r0_medians = [median(run[0]["step_s"]) or 0.0 for run in runs]
    slowest = [median([max(ts) for ts in zip(*(r["step_s"] for r in run))]) or 0.0 for run in runs]
    step = median(r0_medians) or float("nan")
    per_rank = lambda key: [round(max(run[k][key] for run in runs), 1) for k in range(world)]  # noqa: E731
    tokens = cfg["batch_size"] * world * cfg["seq_len"] * cfg["micro_batches"]
    metrics: dict[str, Any] = {
        "step_s": step,
        "slowest_rank_step_s": median(slowest),
        "min_step_s": min(min(run[0]["step_s"]) for run in runs),
        "tokens_per_s": tokens / step,
        "cpu_s_per_step": median([c for run in runs for c in run[0]["cpu_s"]]),
        "peak_rss_mib": per_rank("peak_rss_mib"),
        "train_rss_increase_mib": per_rank("train_rss_increase_mib"),
        "final_loss": last[0]["losses"][-1],
        "num_params": last[0]["num_params"],
    }
    sent = {k: median([c.get(k, 0) for c in last[0]["comm_bytes"]]) or 0 for k in KINDS}
    if any(sent.values()):
        metrics.update({f"{k}_mib": v / 2**20 for k, v in sent.items()})
        metrics["reduce_mib"] = (sent["reduce_scatter"] + sent["all_reduce"]) / 2**20
        # bytes that leave a shard group: a hybrid contender's all-reduce only, anyone else's every collective
        if world > cfg["shard_group_size"]:
            hybrid = reg.get(name).options.get("strategy", "").startswith("HYBRID")
            metrics["cross_group_mib"] = (sent["all_reduce"] if hybrid else sum(sent.values())) / 2**20
    if last[0].get("node_bytes"):
        metrics.update(node_metrics(last[0]["node_bytes"], step, cfg["cross_node_gbps"]))
    kept = ("trainable_params", "saved_activations_mib", "held_activations_mib")
    for key in (*kept, "cuda_max_allocated_mib", "cuda_alloc_retries"):
        if key in last[0]:
            metrics[key] = [r[key] for r in last] if key.startswith("cuda") else last[0][key]
    if "memory_poll" in last[0]:
        metrics["private_peak_mib"] = last[0]["memory_poll"]["private_peak_mib"]
        metrics["node_peak_mib"] = last[0]["memory_poll"]["node_peak_mib"]
    if last[0]["overlap"]:
        for key in last[0]["overlap"][0]:
            metrics[key] = [median([s.get(key, 0.0) for s in r["overlap"]]) for r in last]
    metrics["flops_per_token"] = flops_per_token(metrics["num_params"], cfg)
    peak = peak_flops(cfg)
    if peak:
        metrics["mfu"] = metrics["tokens_per_s"] * metrics["flops_per_token"] / peak
    metrics["float8"] = reg.float8(name, cfg)
    return Row(name=name, contender=name, metrics=metrics, runs=runs)


def node_metrics(per_step: list[dict[str, float]], step_s: float, gbps: float) -> dict[str, float]:
    """``--ranks-per-node``: one rank's bytes per optimizer step (the median over the timed steps), intra-node and
    cross-node, the cross-node ones by collective and phase, and the link model (see [Note: the cross-node link
    model] in ``benchmarks/nodes.py``): ``modelled_step_s = step_s + link_s``."""

    def mib(scope: str, phase: str | None = None, kind: str | None = None) -> float:
        return (median([nodes.summed(s, scope, phase, kind) for s in per_step]) or 0.0) / 2**20

    link = median([s.get("cross_node_link", 0.0) for s in per_step]) or 0.0
    out = {
        "intra_node_mib": mib("intra_node"),
        "cross_node_mib": mib("cross_node"),
        "cross_node_all_gather_forward_mib": mib("cross_node", "forward", "all_gather"),
        "cross_node_all_gather_backward_mib": mib("cross_node", "backward", "all_gather"),
        "cross_node_reduce_scatter_mib": mib("cross_node", None, "reduce_scatter"),
        "cross_node_all_reduce_mib": mib("cross_node", None, "all_reduce"),
        "cross_node_link_mib": link / 2**20,
        "link_s": nodes.link_s(link, gbps),
    }
    out["modelled_step_s"] = step_s + out["link_s"]
    return out


# the dense bf16 peak (FLOP/s, no sparsity) by device name; the first name found in the device's name counts
BF16_PEAKS = {
    "A100": 312e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989.5e12,  # SXM
    "H200": 989.5e12,
    "B200": 2.25e15,
}


def flops_per_token(num_params: int, cfg: dict[str, Any]) -> int:
    """torchtitan's formula, ``6 N + 12 layers heads head_dim seq``: N the parameters less the embeddings'; the
    token embedding is the output head's weight here (tied), whose matmul counts, so only the position
    embedding (``seq x d``) is left out. ``heads x head_dim`` is ``d_model``."""
    d, layers, seq = cfg["d_model"], cfg["n_layer"], cfg["seq_len"]
    return int(6 * (num_params - seq * d) + 12 * layers * d * seq)


def peak_flops(cfg: dict[str, Any]) -> float | None:
    """The dense peak of the devices in use, FLOP/s: ``--peak-tflops`` per device, else on CUDA the GPU's bf16
    peak (:data:`BF16_PEAKS`), for float8 rows too (as torchtitan reports their MFU); on CPU none. The devices:
    the GPUs in use (ranks sharing one count it once), or on CPU the ranks."""
    if cfg["device"] == "cuda":
        devices = min(cfg["world_size"], torch.cuda.device_count())
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in BF16_PEAKS.items() if k in name), None)
    else:
        devices, peak = cfg["world_size"], None
    if cfg.get("peak_tflops"):
        peak = cfg["peak_tflops"] * 1e12
    return peak * devices if peak else None


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    """flatshard over every other row, and each other flatshard row over its FSDP2 twin (``flatshard_compiled``
    over ``fsdp2_compiled``, ``flatshard_compiled_float8`` over ``fsdp2_compiled_float8``)."""
    names = [r.name for r in rows]
    pairs = [("flatshard", n) for n in names]
    twins = [(n, "fsdp2" + n[len("flatshard") :]) for n in names if n.startswith("flatshard_")]
    return pairs + [(a, b) for a, b in twins if b in names]


def _losses_close(tol: float) -> Any:
    def close(row: Row, ref: Row) -> str | None:
        a, b = row.runs[-1][0]["losses"], ref.runs[-1][0]["losses"]
        worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
        return None if worst <= tol else f"losses differ from {ref.name}'s by {worst:.2e} (> {tol:g})"

    return close


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    runs, errors = interleaved(
        contenders, cfg["repeats"], lambda c: reg.run_ranks(train_rank, cfg["world_size"], c, cfg, cfg=cfg)
    )
    rows = [failed(c, errors[c]) if c in errors else summarize(c, runs[c], cfg) for c in contenders]
    mixed = cfg["precision"] == "bf16-mixed" or cfg["base_dtype"] == "bf16"
    notes = []
    for in_float8 in (False, True):  # float8 rows against float8 rows: the same torchao math on both sides
        group = [r for r in rows if reg.float8(r.contender, cfg) == in_float8]
        ok = [r for r in group if r.ok]
        reference = next((r for r in ok if r.contender == "ddp"), ok[0] if ok else None)
        check_against(group, reference, _losses_close(2e-2 if mixed else 1e-3))
    if any(reg.float8(c, cfg) for c in contenders):
        notes.append(
            "float8: torchao's tensorwise recipe on every Block linear (lm_head in high precision); flatshard "
            "and FSDP2 all-gather float8 weights, FSDP1 high-precision ones (torchao has no FSDP1 float8 "
            "all-gather), DDP none (the same float8 matmuls everywhere); FSDP2 runs "
            "precompute_float8_dynamic_scale_for_fsdp after each optimizer step"
        )
        if cfg["device"] == "cpu":
            notes.append(
                "float8 on CPU: torch._scaled_mm is emulated, slowly; the rows show they run and agree"
            )
    peak = peak_flops(cfg)
    if peak and any("mfu" in r.metrics for r in rows):
        notes.append(
            f"MFU: torchtitan's 6 N + 12 layers d seq FLOPs per token against {peak / 1e12:g} TFLOPS "
            "dense (all devices in use; float8 rows against the same bf16 peak, as torchtitan reports them)"
        )
    if any("all_reduce_mib" in r.metrics for r in rows):
        notes.append(
            "bytes per collective: what rank 0 passed into flatshard's collectives per step (input size)"
        )
    if cfg.get("ranks_per_node"):
        rpn, world = cfg["ranks_per_node"], cfg["world_size"]
        notes.append(
            f"nodes: {world // rpn} x {rpn} ranks (node = rank // {rpn}); MiB per optimizer step of rank 0, as "
            "flatshard counts them per process group (a collective's input); intra-node: groups inside one "
            "node, cross-node: groups spanning nodes; DDP's own reducer is not counted"
        )
        notes.append(
            f"modelled step = measured step + link s: a MODEL, not a measurement. Link MiB: rank 0's share of "
            f"its node's cross-node ring links (benchmarks/nodes.py), at {cfg['cross_node_gbps']:g} Gbit/s per "
            "rank, no overlap"
        )
    if any(r.ok and not all(x["hwm_reset"] for x in r.runs[-1]) for r in rows):
        notes.append("VmHWM could not be reset: peak RSS is the process-lifetime peak")
    return rows, notes
