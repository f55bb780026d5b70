"""Step time and memory of flatshard against torch FSDP1, torch FSDP2 and DDP, in one run.

Every contender trains the same GPT (``examples/gpt/model.py``) from the same seed on the same random
token batches, on ``--world-size`` ranks (default: 2 on CPU, every GPU on CUDA), each contender in freshly spawned processes with a
fresh process group (gloo on CPU, NCCL with one GPU per rank on CUDA). Per contender it records the
median wall time of a training step (forward + loss + backward + ``AdamW.step()`` + ``zero_grad()``,
measured with ``time.perf_counter`` after a barrier), tokens/s, peak RSS per rank during training (and on
CUDA the allocator's peaks), the parameter count and the losses, so the reader can check that every
contender trained the same model.

    python benchmarks/step_time.py --preset cpu-small
    python benchmarks/step_time.py --preset cpu-large --steps 5 --warmup 2
    python benchmarks/step_time.py --preset cuda-1b            # every GPU; on 1 GPU: no communication
    python benchmarks/step_time.py --preset cpu-small --compiled-vs-eager   # flatshard with / without compile

Writes ``docs/bench/step_time_<preset>.json`` and ``.png`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_contenders import (
    CONTENDER_DESCRIPTIONS,
    barrier,
    spawn_ranks,
    wrap_contender,
)
from bench_measure import MIB, MemoryPoller, median, mib, proc_status_kib, reset_peak_rss, shmem_kib
from bench_model import MODEL_FIELDS, PRESETS, add_lora, build_model, local_numel, make_batches
from bench_output import (
    default_out,
    indent,
    machine_info,
    utc_now,
    write_json,
)
from step_time_report import compute_ratios, format_ratios, format_table, model_flops_utilization, plot

ALL_CONTENDERS = (
    "flatshard",
    "fsdp1",
    "fsdp2",
    "ddp",
    "flatshard_grad_op",
    "fsdp1_grad_op",
    "fsdp2_grad_op",
    "flatshard_compiled",
    "flatshard_root_resharded",
    "flatshard_adamw",  # with --optimizer muon: flatshard with AdamW on everything, the elementwise baseline
)
DEFAULT_CONTENDERS = ("flatshard", "fsdp1", "fsdp2", "ddp", "flatshard_grad_op")


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------------


def run_contender(rank: int, world_size: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank of a fresh process group; returns this rank's measurements."""
    torch.set_num_threads(cfg["threads"])
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        # One GPU per rank under NCCL; under --backend gloo ranks may share GPUs (rank modulo the count).
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    info: dict[str, Any] = {"rank": rank, "precision_used": cfg["precision"]}
    pids: list[Any] = [None] * world_size
    if cfg["poll_memory"]:  # private memory of every rank, and the node's with shared pages once
        dist.all_gather_object(pids, os.getpid())
        shmem_base = shmem_kib()  # before the model: the transport's segments count in the node's total
    t_setup = time.perf_counter()

    model = build_model(cfg)
    if cfg["lora"]:  # a fine-tune: the base frozen, adapters on the MLP linears (in the same units)
        if (
            cfg.get("base_dtype") == "bf16"
        ):  # the base kept in bf16, the adapters in fp32, as peft builds them
            model = model.to(torch.bfloat16)
        torch.manual_seed(cfg["seed"] + 1)
        info["trainable_params"] = add_lora(model, cfg["lora"])
    info["num_params"] = sum(p.numel() for p in model.parameters())  # tied weight counted once
    model = wrap_contender(name, model, cfg, rank, device, info)
    info["local_param_numel"] = local_numel(model)
    optimizer = _optimizer(name, model, cfg)
    batches = make_batches(cfg, rank, world_size, device)
    mixed = info["precision_used"] == "bf16-mixed"
    autocast = (
        (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if mixed
        else contextlib.nullcontext
    )
    vocab = cfg["vocab_size"]

    def step(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with autocast():
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    gc.collect()
    barrier(device)
    info["setup_s"] = time.perf_counter() - t_setup
    st = proc_status_kib("VmHWM", "VmRSS")
    info["rss_after_setup_mib"] = mib(st["VmRSS"])
    info["hwm_after_setup_mib"] = mib(st["VmHWM"])  # process-lifetime peak: includes building the model
    info["hwm_reset"] = reset_peak_rss()
    if device.type == "cuda":
        info["cuda_allocated_after_setup_mib"] = torch.cuda.memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)

    poller = MemoryPoller(pids, shmem_base) if cfg["poll_memory"] and rank == 0 else contextlib.nullcontext()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    poller.__enter__()
    losses: list[torch.Tensor] = []
    times: list[float] = []
    warmup_times: list[float] = []  # the first one compiles, for flatshard_compiled
    for i, (idx, tgt) in enumerate(batches):
        barrier(device)
        t0 = time.perf_counter()
        loss = step(idx, tgt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(loss)
        (times if i >= cfg["warmup"] else warmup_times).append(dt)

    poller.__exit__(None, None, None)
    if isinstance(poller, MemoryPoller):
        info["memory_poll"] = poller.result()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    # CPU time and page faults of this rank over warmup + timed steps: a high system time / minor-fault
    # count means allocation churn (large tensors mmap'd and unmapped every step), not computation.
    info["train_user_s"] = round(ru1.ru_utime - ru0.ru_utime, 3)
    info["train_sys_s"] = round(ru1.ru_stime - ru0.ru_stime, 3)
    info["train_minor_faults"] = ru1.ru_minflt - ru0.ru_minflt
    st = proc_status_kib("VmHWM", "VmRSS")
    info["peak_rss_train_mib"] = mib(st["VmHWM"])  # training peak if hwm_reset, else process peak
    info["rss_after_train_mib"] = mib(st["VmRSS"])
    if st["VmHWM"] is not None and info["rss_after_setup_mib"] is not None:
        info["peak_rss_increase_mib"] = round(st["VmHWM"] / 1024 - info["rss_after_setup_mib"], 1)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        info["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        info["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
        info["cuda_num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        info["cuda_phase_peaks_mib"] = _phase_peaks(model, optimizer, autocast, batches[-1], vocab, device)

    # Global mean loss per step (outside the timed region).
    local = torch.stack(losses).float()
    dist.all_reduce(local)
    info["losses"] = [round(v / world_size, 6) for v in local.cpu().tolist()]
    info["step_times_s"] = times
    info["warmup_step_times_s"] = warmup_times
    return info


class _Optimizers:
    """Several optimizers stepped as one (Muon on the hidden matrices, AdamW on the rest)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _optimizer(name: str, model: torch.nn.Module, cfg: dict[str, Any]) -> Any:
    """AdamW over the trainable parameters; with ``--optimizer muon``, torch's Muon on the blocks' matrices and
    AdamW on the rest (embeddings, head, norms, biases), as Muon's recipes split them."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.get("optimizer_name", "adamw") == "adamw" or name == "flatshard_adamw":
        return torch.optim.AdamW([p for _, p in trainable], lr=1e-4)
    context: Any = contextlib.nullcontext()
    if name.startswith("flatshard"):  # Muon checks p.ndim == 2 when built: the original shapes
        import flatshard

        context = flatshard.original_shapes(model)
    with context:
        hidden = [p for n, p in trainable if p.ndim == 2 and ".blocks." in f".{n}"]
        rest = [p for n, p in trainable if not (p.ndim == 2 and ".blocks." in f".{n}")]
        return _Optimizers([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-4)])


def _phase_peaks(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    autocast: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    vocab: int,
    device: torch.device,
) -> dict[str, float]:
    """One more (untimed) step, after the measurements, with the allocator's peak read per phase: where a
    difference in peak memory between contenders comes from."""
    idx, tgt = batch
    out: dict[str, float] = {"before_step": torch.cuda.memory_allocated(device) / MIB}

    def phase(name: str, fn: Any) -> Any:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        out[name] = torch.cuda.max_memory_allocated(device) / MIB
        out[name + "_end"] = torch.cuda.memory_allocated(device) / MIB
        return result

    def forward() -> torch.Tensor:
        with autocast():
            return F.cross_entropy(model(idx).float().view(-1, vocab), tgt.view(-1))

    loss = phase("forward", forward)
    phase("backward", loss.backward)
    del loss
    phase("optimizer_step", optimizer.step)
    phase("zero_grad", lambda: optimizer.zero_grad(set_to_none=True))
    return {k: round(v, 1) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def summarize(name: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any], world_size: int) -> dict:
    """Aggregate the per-rank results of one or more runs (repeats) of a contender."""
    tokens_per_step = cfg["batch_size"] * world_size * cfg["seq_len"]
    rank0_medians = [median(r[0]["step_times_s"]) for r in runs]
    # Per step, the slowest rank sets the pace; median of that over steps.
    slowest = [median([max(ts) for ts in zip(*[rank["step_times_s"] for rank in r])]) or 0.0 for r in runs]
    med = statistics.median([m for m in rank0_medians if m is not None])
    last = runs[-1]
    res: dict[str, Any] = {
        "status": "ok",
        "description": CONTENDER_DESCRIPTIONS[name],
        "num_params": last[0]["num_params"],
        "local_param_numel_per_rank": [r["local_param_numel"] for r in last],
        "median_step_s": med,
        "median_step_s_per_run": rank0_medians,
        "median_step_s_per_rank": [median(r["step_times_s"]) for r in last],
        "max_over_ranks_median_step_s": max(median(r["step_times_s"]) or 0.0 for r in last),
        "median_of_slowest_rank_step_s": statistics.median(slowest),
        "min_step_s": min(min(r[0]["step_times_s"]) for r in runs),
        "tokens_per_s": tokens_per_step / med if med else None,
        "step_times_s_per_rank": [[round(t, 5) for t in r["step_times_s"]] for r in last],
        "setup_s": max(r["setup_s"] for r in last),
        "peak_rss_train_mib_per_rank": [r["peak_rss_train_mib"] for r in last],
        "peak_rss_increase_mib_per_rank": [r.get("peak_rss_increase_mib") for r in last],
        "rss_after_setup_mib_per_rank": [r["rss_after_setup_mib"] for r in last],
        "hwm_after_setup_mib_per_rank": [r["hwm_after_setup_mib"] for r in last],
        "rss_after_train_mib_per_rank": [r["rss_after_train_mib"] for r in last],
        "hwm_reset": all(r["hwm_reset"] for r in last),
        "train_user_s_per_rank": [r["train_user_s"] for r in last],
        "train_sys_s_per_rank": [r["train_sys_s"] for r in last],
        "train_minor_faults_per_rank": [r["train_minor_faults"] for r in last],
        "losses": last[0]["losses"],
        "first_loss": last[0]["losses"][0],
        "final_loss": last[0]["losses"][-1],
        "precision_used": last[0]["precision_used"],
        "warmup_step_s_rank0": [round(t, 3) for t in last[0].get("warmup_step_times_s", [])],
    }
    if "memory_poll" in last[0]:  # sampled by rank 0 over the warmup and timed steps
        poll = last[0]["memory_poll"]
        res["private_peak_mib_per_rank"] = poll["private_peak_mib"]
        res["node_peak_mib"] = poll["node_peak_mib"]
        res["node_before_mib"] = poll["node_before_mib"]
    for key in ("trainable_params",):
        if key in last[0]:
            res[key] = last[0][key]
    for key in ("flatshard_options", "fsdp1_options", "compiled_units", "compile_kwargs"):
        if key in last[0]:
            res[key] = last[0][key]
    if cfg["device"] == "cuda":
        for key in (
            "cuda_max_allocated_mib",
            "cuda_max_reserved_mib",
            "cuda_num_alloc_retries",
            "cuda_allocated_after_setup_mib",
            "cuda_phase_peaks_mib",
        ):
            res[key + "_per_rank"] = [r.get(key) for r in last]
        res.update(model_flops_utilization(res["tokens_per_s"], res["num_params"], cfg, world_size))
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small", help="model/batch preset")
    for field in MODEL_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the preset's")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16-mixed"],
        default=None,
        help="default: fp32 on CPU, bf16-mixed on CUDA (fp32 master weights; bf16 compute via autocast\n"
        "and each framework's mixed-precision config, which also all-gathers bf16 parameters)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="gradient-reduction dtype of the sharded frameworks under bf16-mixed",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default: 2 on CPU; on CUDA every visible GPU, one rank each; with 1 GPU the\n"
        "sharded contenders have nothing to communicate, which measures their compute and memory overheads)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: NCCL on CUDA (one GPU per rank), gloo on CPU. gloo on CUDA lets ranks share GPUs\n"
        "(rank modulo the GPU count): two processes on one GPU exercise the stream protocol",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, run in this order; choices: {', '.join(ALL_CONTENDERS)}",
    )
    p.add_argument("--repeats", type=int, default=1, help="run every contender this many times (interleaved)")
    p.add_argument(
        "--compiled-vs-eager",
        action="store_true",
        help="run flatshard and flatshard_compiled (each Block compiled in place after sharding, as\n"
        "FlatShardStrategy(compile=...) does) in the same run, instead of --contenders, and report\n"
        "compiled / eager step time. The first warmup step compiles (reported as warmup_step_s_rank0)",
    )
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of flatshard_compiled"
    )
    p.add_argument("--compile-mode", default=None, help="torch.compile mode of flatshard_compiled")
    p.add_argument(
        "--flatshard-backward-prefetch",
        choices=["auto", "BACKWARD_PRE", "BACKWARD_POST", "none"],
        default="auto",
        help="auto: BACKWARD_PRE, or None if this flatshard raises NotImplementedError for it.\n"
        "An explicit value is passed through as is (the contender fails if unsupported).",
    )
    p.add_argument(
        "--flatshard-forward-prefetch",
        nargs="?",
        const="on",
        choices=["on", "off", "auto"],
        default="off",
        help="off (default, like FSDP1's default), on (bare flag), or auto (on if supported)",
    )
    p.add_argument(
        "--fsdp1-forward-prefetch",
        choices=["same", "off"],
        default="same",
        help="same (default): FSDP1 prefetches in forward when flatshard does; off: FSDP1 keeps its default",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a contender may run")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="fine-tune: freeze the whole model and train rank-R adapters on every block's MLP linears\n"
        "(AdamW over the adapters only); 0 (default): train everything",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="adamw (default); muon: torch.optim.Muon on the blocks' matrices, AdamW on the rest (flatshard makes\n"
        "each matrix whole on an owner rank for the step; FSDP1/FSDP2 give Muon 1-D pieces and fail)",
    )
    p.add_argument(
        "--base-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="with --lora: the frozen base's dtype (bf16: the adapters stay fp32, in the same units)",
    )
    p.add_argument(
        "--poll-memory",
        action="store_true",
        help="sample every rank's private memory (RssAnon + RssFile) and the node's (private + shared pages\n"
        "once) every 5 ms from rank 0 during training: peak RSS counts the transport's shared pages in\n"
        "every rank that maps them",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes next to it")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ for the ranks (e.g. 65536) so freed tensors go back to the OS\n"
        "and RSS tracks live memory more closely (changes allocation cost; off by default)",
    )
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(PRESETS[args.preset])
    overrides = {}
    for field in MODEL_FIELDS:
        v = getattr(args, field)
        if v is not None:
            overrides[field] = v
    if args.device is not None:
        overrides["device"] = args.device
    cfg.update(overrides)
    cfg["precision"] = args.precision or ("bf16-mixed" if cfg["device"] == "cuda" else "fp32")
    cfg.update(
        preset=args.preset,
        overrides=overrides,
        reduce_dtype=args.reduce_dtype,
        steps=args.steps,
        warmup=args.warmup,
        world_size=args.world_size,
        seed=args.seed,
        threads=args.threads,
        flatshard_backward_prefetch=args.flatshard_backward_prefetch,
        flatshard_forward_prefetch=args.flatshard_forward_prefetch,
        fsdp1_forward_prefetch=args.fsdp1_forward_prefetch,
        optimizer="AdamW(lr=1e-4) over the trainable parameters, other defaults"
        if args.optimizer == "adamw"
        else "Muon(lr=0.02) on the blocks' matrices, AdamW(lr=1e-4) on the rest",
        timed_region="forward + cross-entropy + backward + optimizer.step() + zero_grad(set_to_none=True)",
        malloc_mmap_threshold=args.malloc_mmap_threshold,
        lora=args.lora,
        optimizer_name=args.optimizer,
        base_dtype=args.base_dtype,
        poll_memory=args.poll_memory,
        compile_kwargs={
            "backend": args.compile_backend,
            **({"mode": args.compile_mode} if args.compile_mode else {}),
        },
    )
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.base_dtype != "fp32" and not args.lora:
        raise SystemExit("--base-dtype sets the frozen base's dtype of a fine-tune: give --lora R too")
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if args.compiled_vs_eager:
        contenders = ["flatshard", "flatshard_compiled"]
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join(ALL_CONTENDERS)}")
    if cfg["world_size"] is None:
        cuda = cfg["device"] == "cuda" and torch.cuda.is_available()
        cfg["world_size"] = torch.cuda.device_count() if cuda else 2
    ws = cfg["world_size"]
    backend = args.backend if args.backend != "auto" else ("nccl" if cfg["device"] == "cuda" else "gloo")
    if backend == "nccl" and cfg["device"] != "cuda":
        raise SystemExit("--backend nccl needs --device cuda")
    cfg["backend"] = backend
    if cfg["device"] == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (backend == "nccl" and n < ws):
            raise SystemExit(
                f"--device cuda with {backend} needs {ws if backend == 'nccl' else 1} GPU(s); found {n}. "
                "HINT: --backend gloo runs several ranks on one GPU"
            )
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # inherited by the ranks
    lora = f"_lora{args.lora}{'_bf16base' if args.base_dtype == 'bf16' else ''}" if args.lora else ""
    out = args.out or default_out(f"step_time_{args.preset}{lora}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    report: dict[str, Any] = {
        "benchmark": "step_time",
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(cfg),
        "config": cfg,
        "contenders": contenders,
        "results": {},
        "ratios": {},
    }
    tokens = cfg["batch_size"] * ws * cfg["seq_len"]
    print(
        f"preset {args.preset}: d_model={cfg['d_model']} n_layer={cfg['n_layer']} n_head={cfg['n_head']} "
        f"vocab={cfg['vocab_size']} seq={cfg['seq_len']} batch/rank={cfg['batch_size']} "
        f"({tokens} tokens/step) | {ws} ranks, {backend}, {cfg['device']}, {cfg['precision']}, "
        f"{cfg['threads']} thread(s)/rank | warmup {cfg['warmup']}, timed {cfg['steps']}, "
        f"repeats {args.repeats}",
        flush=True,
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in contenders}
    loads: dict[str, list[list[float]]] = {c: [] for c in contenders}
    errors: dict[str, str] = {}
    for rep in range(args.repeats):
        for name in contenders:
            if name in errors:
                continue
            t0 = time.perf_counter()
            print(f"[{rep + 1}/{args.repeats}] {name}: {CONTENDER_DESCRIPTIONS[name]} ...", flush=True)
            try:
                per_rank = spawn_ranks(run_contender, ws, name, cfg, backend=backend, timeout=args.timeout)
            except Exception as err:  # a rank failed: record it and go on with the others
                errors[name] = f"{type(err).__name__}: {err}"
                print(
                    f"    FAILED after {time.perf_counter() - t0:.1f}s:\n{indent(errors[name])}", flush=True
                )
                continue
            runs[name].append(per_rank)
            loads[name].append([round(x, 2) for x in os.getloadavg()])
            med = median(per_rank[0]["step_times_s"])
            print(
                f"    done in {time.perf_counter() - t0:.1f}s (load avg {loads[name][-1][0]:.1f}): "
                f"median step {med:.4f}s, "
                f"peak RSS {[r['peak_rss_train_mib'] for r in per_rank]} MiB, "
                f"final loss {per_rank[0]['losses'][-1]:.5f}",
                flush=True,
            )
    for name in contenders:
        if name in errors:
            res = {"status": "failed", "description": CONTENDER_DESCRIPTIONS[name], "error": errors[name]}
            if runs[name]:
                res["completed_runs_before_failure"] = len(runs[name])
            report["results"][name] = res
        else:
            try:
                report["results"][name] = summarize(name, runs[name], cfg, ws)
                report["results"][name]["loadavg_after_run"] = loads[name]
            except Exception:
                report["results"][name] = {
                    "status": "failed",
                    "description": CONTENDER_DESCRIPTIONS[name],
                    "error": traceback.format_exc(),
                }
    report["ratios"] = compute_ratios(report["results"])
    compiled = report["ratios"].get("flatshard_compiled/flatshard")
    if compiled is not None:
        report["compiled_vs_eager"] = {
            "step_time_ratio": compiled["step_time_ratio"],
            "min_step_time_ratio": compiled["min_step_time_ratio"],
            "peak_rss_ratio": compiled["peak_rss_ratio"],
            "compile_kwargs": cfg["compile_kwargs"],
        }
    report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    ok = [r for r in report["results"].values() if r.get("status") == "ok"]
    notes = []
    if ok:
        first = [r["first_loss"] for r in ok]
        final = [r["final_loss"] for r in ok]
        report["loss_check"] = {
            "first_loss_spread": max(first) - min(first),
            "final_loss_spread": max(final) - min(final),
        }
        if max(final) - min(final) > 1e-2 * max(1.0, abs(statistics.median(final))):
            notes.append("final losses differ by more than 1% between contenders: check the loss column")
    for name, r in report["results"].items():
        fo = r.get("flatshard_options")
        if fo:
            notes.append(
                f"{name}: ran with backward_prefetch={fo['backward_prefetch']!r}, "
                f"forward_prefetch={fo['forward_prefetch']!r}, mixed_precision={fo['mixed_precision']}"
            )
        fb = (fo or {}).get("fallbacks")
        if fb:
            notes.append(f"{name}: fell back from unimplemented options: " + "; ".join(fb))
        if "fp32" in str(r.get("precision_used", "")) and cfg["precision"] == "bf16-mixed":
            notes.append(f"{name}: ran in fp32, not bf16-mixed")
        busy = [la[0] for la in r.get("loadavg_after_run", []) if la[0] > ws + 0.75]
        if busy and (os.cpu_count() or 0) <= 2 * ws:
            notes.append(
                f"{name}: 1-min load average {max(busy):.1f} after its run (its own {ws} ranks account "
                f"for ~{ws}): other processes competed for the CPUs; its times are inflated"
            )
        if r.get("status") == "ok" and not r.get("hwm_reset"):
            notes.append(f"{name}: could not reset VmHWM; peak RSS is the process-lifetime peak")
    report["notes"] = notes

    table = format_table(report["results"], report["ratios"], cfg["device"] == "cuda")
    report["table"] = table
    print()
    print(table)
    if report["ratios"]:
        print("\nratios (flatshard variant / peer; < 1 means flatshard is faster or smaller):")
        print(format_ratios(report["ratios"]))
    if "compiled_vs_eager" in report:
        c = report["compiled_vs_eager"]
        print(
            f"\ncompiled / eager (flatshard_compiled / flatshard): step time x{c['step_time_ratio']:.3f} "
            f"(min x{c['min_step_time_ratio']:.3f}), peak RSS x{c['peak_rss_ratio']:.3f}"
        )
    for n in notes:
        print("note:", n)
    write_json(out, report, default=str)
    png = out.with_suffix(".png")
    title = (
        f"step_time {args.preset}: d{cfg['d_model']} L{cfg['n_layer']} V{cfg['vocab_size']} "
        f"B{cfg['batch_size']}x{ws} T{cfg['seq_len']}, {cfg['device']} {cfg['precision']}, "
        f"torch {torch.__version__}, {report['date'][:10]}"
    )
    try:
        plot(report["results"], cfg, png, title)
    except Exception as err:  # the JSON is the primary output
        print(f"plot failed: {type(err).__name__}: {err}")
    else:
        print(f"\nwrote {out} and {png}")
    return 1 if contenders and len(errors) == len(contenders) else 0


if __name__ == "__main__":
    sys.exit(main())
