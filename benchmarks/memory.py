"""Peak memory per rank against model size at world sizes 1, 2 and 4, next to the theoretical footprint.

For each GPT size in ``--sizes``, each world size in ``--world-sizes`` and each contender in ``--contenders``
(flatshard FULL_SHARD, torch FSDP1 FULL_SHARD, torch FSDP2 ``fully_shard`` and DDP, built as
``benchmarks/step_time.py`` builds them, one unit per ``Block``), fresh gloo ranks (one intra-op thread
each) build the GPT (``examples/gpt/model.py``, vocab ``--vocab-size``), shard or replicate it, create
``AdamW(lr=1e-4)`` and train ``--steps`` steps on random tokens (``--batch-size`` sequences of ``--seq-len``
per rank). Per rank it records

* **measured** = peak RSS during training (``VmHWM``, reset with ``clear_refs`` after setup) minus the RSS
  right before the model is built (after imports, process-group init, making the batches, a one-parameter
  AdamW step for the modules it imports on first use, one plain-torch step of a tiny GPT for the code pages
  of the kernels, gc, a barrier);
* **theory** = (parameters + gradients + 2 AdamW states, fp32) / N (this rank's padded shard)
  + the largest unit unsharded (its parameters + its gradient; 0 at N = 1, where the shard *is* the
  unsharded unit) + the activations autograd saves for backward (counted with
  ``flatshard.testing.activations.saved_activation_bytes`` on the world-1 run's forward + loss);

next to **measured with shared pages once**: the same minus the shared-memory transport's pages that RSS counts
in every rank mapping them (``RssShmem - Pss_Shmem``), so the ranks' figures add up to the host's memory;
and what explains the difference: RSS after setup, per-phase peaks, file-backed (code) pages touched,
glibc's own accounting (``mallinfo2``: freed memory malloc keeps) and how much RSS ``malloc_trim(0)``
gives back after training. Every point runs twice by default: with glibc's default malloc settings (the
headline numbers) and with ``MALLOC_MMAP_THRESHOLD_=65536`` (blocks of 64 KiB and more are mapped and
unmapped on free, so RSS follows live memory: the diagnostic run). The theory is flatshard's (its units,
its shard padding) for every contender; a side-by-side table gives each contender's peak, its ratio to the
theory and flatshard's peak over each peer's.

    python benchmarks/memory.py                                          # ~20 min on 2 cores
    python benchmarks/memory.py --allocators glibc --contenders flatshard  # flatshard alone, ~2.5 min

Writes ``docs/bench/memory_cpu.json`` and ``docs/bench/memory_cpu.png`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_contenders import CONTENDER_DESCRIPTIONS, wrap_contender
from bench_measure import MIB, proc_status_kib, reset_peak_rss, rss_kib
from bench_model import Block, build_model, local_numel, make_batches
from bench_output import default_out, machine_info, utc_now, write_json
from memory_report import format_side_by_side, format_table, format_theory, plot

FP32 = 4
TOLERANCE = 0.15
CONTENDERS = ("flatshard", "fsdp1", "fsdp2", "ddp")  # as benchmarks/step_time.py builds them, fp32
PHASES = ("forward", "backward", "optimizer")


RSS_KEYS = ("VmRSS", "RssAnon", "RssFile")
ALLOCATORS = {
    # name: MALLOC_MMAP_THRESHOLD_ for the ranks (None: glibc's default, a dynamic threshold)
    "glibc": None,
    "mmap64k": "65536",
}


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


def _malloc_kib(libc: Any | None) -> dict[str, int] | None:
    """glibc's own accounting over all arenas: bytes in use, free but kept, and mmap'd chunks."""
    if libc is None:
        return None
    mi = libc.mallinfo2()
    return {
        "in_use": mi.uordblks // 1024,  # allocated from the arenas (sbrk/heap memory)
        "free_kept": mi.fordblks // 1024,  # freed, still owned by malloc (RSS if the pages were touched)
        "arena": mi.arena // 1024,  # arena address space (in use + free)
        "mmapped": mi.hblkhd // 1024,  # chunks above the mmap threshold (unmapped on free)
    }


def _rss_split_kib() -> dict[str, int]:
    return {k: v or 0 for k, v in proc_status_kib(*RSS_KEYS).items()}


def _shmem_kib() -> dict[str, int]:
    """Shared-memory pages this process maps: resident (``RssShmem``) and its proportional share
    (``Pss_Shmem``: each page divided by the number of processes mapping it)."""
    rss = proc_status_kib("RssShmem")["RssShmem"] or 0
    pss = proc_status_kib("Pss_Shmem", path="/proc/self/smaps_rollup")["Pss_Shmem"]
    return {"rss": rss, "pss": rss if pss is None else pss}  # no smaps_rollup: count shared pages fully


def _phase_peak_kib() -> int:
    """VmHWM since the last reset, then reset it again (to the current RSS)."""
    peak = proc_status_kib("VmHWM")["VmHWM"] or 0
    reset_peak_rss()
    return peak


def _warm_up_imports() -> None:
    """Run what imports modules lazily on first use (an AdamW step imports ``torch._dynamo``: ~45 MiB of RSS
    that any training process pays once, whatever the model or strategy), so the baseline includes it."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=1e-4)
    (p * 2).sum().backward()
    opt.step()


def _warm_up_kernels(cfg: dict[str, Any]) -> None:
    """One unsharded training step of a 1-layer, d_model 64 GPT of the same vocabulary and batch shape, so
    the baseline includes the code pages of the kernels training runs (file-backed libtorch pages, ~10 MiB,
    the same for every model size and world size). Plain torch: nothing of flatshard's is set up here, so
    its own buffers (the transport's segments among them) are all measured."""
    tiny = build_model(dict(cfg, d_model=64, n_layer=1, n_head=1))
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"]))
    F.cross_entropy(tiny(idx).view(-1, cfg["vocab_size"]), idx.view(-1)).backward()
    opt.step()
    del tiny, opt, idx


def run(
    rank: int, world: int, cfg: dict[str, Any], contender: str, count_activations: bool
) -> dict[str, Any]:
    """Train one size on one rank with ``contender``; return RSS figures (KiB) and, for flatshard, the model's
    unit sizes."""
    torch.set_num_threads(cfg["threads"])
    from flatshard.testing.activations import saved_activation_bytes

    batches = make_batches(dict(cfg, warmup=0), rank, world, torch.device("cpu"))
    _warm_up_imports()
    _warm_up_kernels(cfg)
    gc.collect()
    dist.barrier()
    libc = _libc()
    info: dict[str, Any] = {"rss_base_kib": rss_kib()}  # everything measured is relative to this
    info["base_split_kib"] = _rss_split_kib()
    info["base_malloc_kib"] = _malloc_kib(libc)

    model = build_model(cfg)
    info["num_params"] = sum(p.numel() for p in model.parameters())  # tied embedding/head once
    info["rss_after_build_kib"] = rss_kib()
    model = _shard(contender, model, cfg, info)
    info["local_param_numel"] = local_numel(model)  # what this rank's parameters hold
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    dist.barrier()
    info["rss_after_setup_kib"] = rss_kib()
    info["hwm_reset"] = reset_peak_rss()

    vocab = cfg["vocab_size"]
    phase_peaks: list[dict[str, int]] = []
    phase_malloc: list[dict[str, Any]] = []  # glibc's accounting at the end of each phase
    losses = []
    for idx, tgt in batches:
        dist.barrier()
        _phase_peak_kib()
        loss = F.cross_entropy(model(idx).view(-1, vocab), tgt.view(-1))
        peaks = {"forward": _phase_peak_kib()}
        mallocs = {"forward": _malloc_kib(libc)}
        loss.backward()
        peaks["backward"] = _phase_peak_kib()
        mallocs["backward"] = _malloc_kib(libc)
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks["optimizer"] = _phase_peak_kib()
        mallocs["optimizer"] = _malloc_kib(libc)
        phase_peaks.append(peaks)
        phase_malloc.append(mallocs)
        losses.append(loss.item())
    info["phase_peaks_kib"] = phase_peaks
    info["peak_kib"] = max(max(p.values()) for p in phase_peaks)
    info["rss_after_train_kib"] = rss_kib()
    info["after_train_split_kib"] = _rss_split_kib()  # RssFile growth: code pages of the kernels used
    info["shmem_kib"] = _shmem_kib()  # the transport's segments: mapped by every rank, resident once
    info["phase_malloc_kib"] = phase_malloc
    if libc is not None:  # how much of the RSS is free memory malloc kept: give it back and look again
        libc.malloc_trim(0)
        info["rss_after_trim_kib"] = rss_kib()
    info["losses"] = losses
    if count_activations:  # after the measured steps, so it cannot change them
        idx, tgt = batches[0]
        info["activation_bytes"], _ = saved_activation_bytes(
            model, lambda: F.cross_entropy(model(idx).view(-1, vocab), tgt.view(-1))
        )
        info["activation_bytes_model_only"], _ = saved_activation_bytes(model, lambda: model(idx))
    return info


def _shard(
    contender: str, model: torch.nn.Module, cfg: dict[str, Any], info: dict[str, Any]
) -> torch.nn.Module:
    """Shard (or replicate) ``model`` as ``contender`` does, one unit per ``Block``; for flatshard, record the
    unit sizes the theory is computed from."""
    if contender != "flatshard":  # the peers exactly as benchmarks/step_time.py builds them
        peer_cfg = dict(
            cfg, precision="fp32", flatshard_forward_prefetch="off", fsdp1_forward_prefetch="same"
        )
        return wrap_contender(contender, model, peer_cfg, dist.get_rank(), torch.device("cpu"), info)

    import flatshard
    from flatshard.engine import unit_states

    prefetch = None if cfg["backward_prefetch"] == "none" else cfg["backward_prefetch"]
    flatshard.shard(
        model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, backward_prefetch=prefetch
    )
    layouts = [h.layout for s in unit_states(model) for h in s.handles]
    info["unit_numels"] = [lay.total_numel for lay in layouts]  # unsharded, the root unit first
    info["unit_padded_numels"] = [lay.padded_numel for lay in layouts]
    info["local_numel"] = sum(lay.shard_numel for lay in layouts)  # this rank's shard, padding included
    return model


def theory(basis: dict[str, Any], world: int, activation_bytes: int) -> dict[str, float]:
    """Theoretical per-rank footprint in bytes, by component, from flatshard's units (``basis``: the
    ``local_numel`` and ``unit_padded_numels`` of its rank 0 at this world size)."""
    local = basis["local_numel"]
    largest = max(basis["unit_padded_numels"])
    parts = {
        "params_shard": FP32 * local,
        "grads_shard": FP32 * local,
        "adamw_states": 2 * FP32 * local,
        # At N = 1 the gathered parameter is the shard itself and the unsharded gradient is the gradient
        # shard: nothing extra. The brief's formula without that exception is kept as "formula_literal".
        "largest_unit_unsharded": 2 * FP32 * largest if world > 1 else 0,
        "activations": activation_bytes,
    }
    parts["total"] = sum(parts.values())
    parts["formula_literal_total"] = parts["total"] - parts["largest_unit_unsharded"] + 2 * FP32 * largest
    return parts


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        d, _, layers = item.strip().lower().partition("x")
        out.append((int(d), int(layers)))
    return out


ALLOCATOR_LABELS = {
    "glibc": "glibc malloc, default dynamic mmap threshold",
    "mmap64k": "MALLOC_MMAP_THRESHOLD_=65536: blocks >= 64 KiB are mmap'd and unmapped on free",
}


def measure(
    cfg: dict[str, Any],
    size: str,
    world: int,
    allocator: str,
    contender: str,
    basis: dict[str, Any] | None,
    activation_bytes: int | None,
    timeout: float,
) -> dict[str, Any]:
    """One (allocator, size, world, contender) point: spawn the ranks and turn their figures into a row.

    The theory is flatshard's: its own units for flatshard, ``basis`` (flatshard's row at this point) for the
    peers, which shard the same model into the same units (DDP is measured against it too: it shows what
    sharding saves)."""
    from flatshard.testing import spawn

    threshold = ALLOCATORS[allocator]
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    # glibc reads the variable when malloc initialises, i.e. at process start: set it for the children.
    if threshold is None:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold
    t0 = time.perf_counter()
    try:
        per_rank = spawn(run, world, cfg, contender, world == 1 and contender == "flatshard", timeout=timeout)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    r0 = per_rank[0]
    if contender == "flatshard":
        basis = {"local_numel": r0["local_numel"], "unit_padded_numels": r0["unit_padded_numels"]}
        if world == 1:
            activation_bytes = r0["activation_bytes"]
    if activation_bytes is None or basis is None:
        raise RuntimeError("no flatshard run of this size (at N = 1, and at this N): theory unknown")
    parts = theory(basis, world, activation_bytes)
    measured = [(r["peak_kib"] - r["rss_base_kib"]) / 1024 for r in per_rank]
    # RSS counts a shared page in every process mapping it; counted once (proportionally), the ranks'
    # figures add up to the host's memory. The segments are made and touched before the measured steps.
    shared_extra = [(r["shmem_kib"]["rss"] - r["shmem_kib"]["pss"]) / 1024 for r in per_rank]
    once = [m - x for m, x in zip(measured, shared_extra, strict=True)]
    setup = [(r["rss_after_setup_kib"] - r["rss_base_kib"]) / 1024 for r in per_rank]
    worst = max(range(world), key=lambda i: measured[i])
    phases = per_rank[worst]["phase_peaks_kib"]
    step, phase = max(
        ((s, ph) for s in range(len(phases)) for ph in PHASES), key=lambda sp: phases[sp[0]][sp[1]]
    )
    theory_mib = parts["total"] / MIB
    base_w = per_rank[worst]["rss_base_kib"]
    row: dict[str, Any] = {
        "allocator": allocator,
        "contender": contender,
        "size": size,
        "d_model": cfg["d_model"],
        "n_layer": cfg["n_layer"],
        "n_head": cfg["n_head"],
        "world": world,
        "num_params": r0["num_params"],
        "theory_basis": basis,
        "local_param_numel_per_rank": [r["local_param_numel"] for r in per_rank],
        "measured_mib_per_rank": [round(x, 1) for x in measured],
        "measured_mib_max_rank": max(measured),
        "theory_mib": theory_mib,
        "theory_parts_mib": {k: v / MIB for k, v in parts.items()},
        "activation_bytes": activation_bytes,
        "ratio_max_rank": max(measured) / theory_mib,
        "ratio_per_rank": [x / theory_mib for x in measured],
        "within_tolerance": abs(max(measured) / theory_mib - 1) <= TOLERANCE,
        "shared_counted_again_mib_per_rank": [round(x, 1) for x in shared_extra],
        "measured_shared_once_mib_per_rank": [round(x, 1) for x in once],
        "ratio_shared_once_max_rank": max(once) / theory_mib,
        "within_tolerance_shared_once": abs(max(once) / theory_mib - 1) <= TOLERANCE,
        "rss_base_mib_per_rank": [r["rss_base_kib"] / 1024 for r in per_rank],
        "build_mib_per_rank": [(r["rss_after_build_kib"] - r["rss_base_kib"]) / 1024 for r in per_rank],
        "setup_mib_per_rank": [round(x, 1) for x in setup],
        "setup_mib_max_rank": max(setup),
        "train_increase_mib_per_rank": [(r["peak_kib"] - r["rss_after_setup_kib"]) / 1024 for r in per_rank],
        "after_train_minus_base_mib_per_rank": [
            (r["rss_after_train_kib"] - r["rss_base_kib"]) / 1024 for r in per_rank
        ],
        "file_backed_growth_mib_per_rank": [
            (r["after_train_split_kib"]["RssFile"] - r["base_split_kib"]["RssFile"]) / 1024 for r in per_rank
        ],
        "anon_growth_after_train_mib_per_rank": [
            (r["after_train_split_kib"]["RssAnon"] - r["base_split_kib"]["RssAnon"]) / 1024 for r in per_rank
        ],
        "peak_phase": f"step {step + 1} {phase}",
        "phase_peaks_minus_base_mib_max_rank": [
            {ph: round((pk[ph] - base_w) / 1024, 1) for ph in PHASES} for pk in phases
        ],
        "hwm_reset": all(r["hwm_reset"] for r in per_rank),
        "losses_rank0": r0["losses"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    mw = per_rank[worst]
    if mw["base_malloc_kib"] is not None:
        at_peak = mw["phase_malloc_kib"][step][phase]
        row["malloc_at_peak_phase_end_minus_base_mib"] = {
            k: round((at_peak[k] - mw["base_malloc_kib"][k]) / 1024, 1) for k in at_peak
        }
        row["malloc_free_kept_max_phase_end_mib"] = round(
            max(m[ph]["free_kept"] for m in mw["phase_malloc_kib"] for ph in PHASES) / 1024, 1
        )
        row["trim_released_mib_per_rank"] = [
            round((r["rss_after_train_kib"] - r["rss_after_trim_kib"]) / 1024, 1) for r in per_rank
        ]
    if world == 1 and contender == "flatshard":
        row["activation_bytes_model_forward_only"] = r0["activation_bytes_model_only"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", default="256x4,384x6,512x8", help="comma list of d_modelxn_layer (heads = d/64)"
    )
    p.add_argument("--world-sizes", default="1,2,4", help="comma list; 1 must be included (activations)")
    p.add_argument(
        "--allocators",
        default="glibc,mmap64k",
        help="comma list: glibc (default malloc settings; the headline result) and/or mmap64k\n"
        "(MALLOC_MMAP_THRESHOLD_=65536, so freed blocks go back to the OS: the diagnostic run)",
    )
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma list from {', '.join(CONTENDERS)}; flatshard is required (the theory is computed from "
        "its units)",
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3, help="training steps (peak over all of them)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--backward-prefetch",
        choices=["BACKWARD_PRE", "BACKWARD_POST", "none"],
        default="BACKWARD_PRE",
        help="flatshard's backward_prefetch (default: its default); none shows what prefetching holds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument(
        "--out", type=Path, default=None, help="default docs/bench/memory_cpu.json (PNG next to it)"
    )
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    worlds = sorted({int(w) for w in args.world_sizes.split(",")})
    allocators = [a.strip() for a in args.allocators.split(",") if a.strip()]
    if worlds[0] != 1:
        raise SystemExit("--world-sizes must include 1: its run measures the activations")
    if max(worlds) > 4:
        raise SystemExit("at most 4 ranks")
    if not allocators or any(a not in ALLOCATORS for a in allocators):
        raise SystemExit(f"--allocators: choose from {', '.join(ALLOCATORS)}")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if "flatshard" not in contenders or any(c not in CONTENDERS for c in contenders):
        raise SystemExit(f"--contenders: flatshard and any of {', '.join(CONTENDERS[1:])}")
    contenders.sort(key=CONTENDERS.index)  # flatshard first: the peers' theory is computed from its units

    base_cfg = {
        "vocab_size": args.vocab_size,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "threads": args.threads,
        "seed": args.seed,
        "device": "cpu",
        "optimizer": "AdamW(lr=1e-4), other defaults",
        "sharding": "one unit per Block, fp32; flatshard FULL_SHARD (theory from its units), peers as listed",
        "backward_prefetch": args.backward_prefetch,
    }
    started = utc_now()
    machine = machine_info(base_cfg)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for allocator in allocators:
        for d_model, n_layer in sizes:
            size = f"{d_model}x{n_layer}"
            cfg = dict(base_cfg, d_model=d_model, n_layer=n_layer, n_head=max(1, d_model // 64))
            activation_bytes = None
            for world in worlds:
                basis = None
                for contender in contenders:
                    point = f"{allocator} {size} N={world} {contender}"
                    try:
                        row = measure(
                            cfg, size, world, allocator, contender, basis, activation_bytes, args.timeout
                        )
                    except Exception as err:  # record it and go on
                        rows.append(
                            {
                                "allocator": allocator,
                                "contender": contender,
                                "size": size,
                                "world": world,
                                "error": f"{type(err).__name__}: {err}",
                            }
                        )
                        print(f"{point}: FAILED\n{err}", flush=True)
                        continue
                    activation_bytes, basis = row["activation_bytes"], row["theory_basis"]
                    rows.append(row)
                    print(
                        f"{point}: {row['num_params'] / 1e6:.2f}M params, measured "
                        f"{row['measured_mib_per_rank']} MiB, theory {row['theory_mib']:.1f} MiB "
                        f"(x{row['ratio_max_rank']:.2f}), setup {row['setup_mib_per_rank']} MiB, "
                        f"peak at {row['peak_phase']}, {row['seconds']:.0f}s",
                        flush=True,
                    )
    table = format_table(rows)
    theory_table = format_theory(rows)
    side_by_side = format_side_by_side(rows, contenders)
    print()
    print(table)
    print()
    print("side by side (max rank):")
    print(side_by_side)
    print()
    print("theory components (MiB per rank):")
    print(theory_table)
    machine["loadavg_at_end"] = list(os.getloadavg())
    out = args.out or default_out("memory_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if "error" not in r]
    ok_flatshard = [r for r in ok if r["contender"] == "flatshard"]
    png = out.with_suffix(".png")
    plot_note = None
    try:
        title = (
            "flatshard FULL_SHARD against theory, peers at the largest N (unit per Block), AdamW fp32, "
            f"vocab {args.vocab_size}, B{args.batch_size} T{args.seq_len} per rank, torch {torch.__version__}, {started[:10]}"
        )
        plot(
            ok, worlds, [a for a in allocators if any(r["allocator"] == a for r in ok_flatshard)], png, title
        )
    except Exception as err:  # e.g. no matplotlib: the JSON is the primary output
        plot_note = f"plot skipped: {type(err).__name__}: {err}"
        print(plot_note)
    report = {
        "benchmark": "memory",
        "date": started,
        "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "machine": machine,
        "config": dict(
            base_cfg, sizes=args.sizes, world_sizes=worlds, allocators=allocators, tolerance=TOLERANCE
        ),
        "contenders": {c: CONTENDER_DESCRIPTIONS[c] for c in contenders},
        "allocators": {a: ALLOCATOR_LABELS[a] for a in allocators},
        "definitions": {
            "measured": "max over ranks of (VmHWM during training, reset with clear_refs after setup) - VmRSS "
            "right before the model is built (after imports, process-group init, making the batches, a "
            "one-parameter AdamW step (lazy imports), "
            "gc.collect() and a barrier)",
            "theory": "16 bytes x this rank's padded shard numel (params, grads, AdamW exp_avg and exp_avg_sq) "
            "+ 8 bytes x the largest unit's padded numel when N > 1 (its gathered parameters and unsharded "
            "gradient; at N = 1 the shard is the unsharded unit) + saved activation bytes (forward + "
            "cross-entropy, counted by flatshard.testing.activations.saved_activation_bytes in the world-1 "
            "run, gathered parameters excluded); formula_literal_total also adds the unit term at N = 1",
            "shared pages once": "measured - (RssShmem - Pss_Shmem) after training: the shared-memory "
            "transport's segments (each rank's own, mapped by every peer) counted once over the ranks instead "
            "of once per rank mapping them; per-rank figures then add up to the host's memory",
            "setup": "VmRSS after shard() and AdamW creation - base (theory: the params shard only)",
            "code pages": "RssFile after training - RssFile at base: file-backed pages (mostly libtorch code) "
            "the run touched for the first time; part of measured, not of theory",
            "malloc free kept": "glibc mallinfo2().fordblks (freed memory malloc keeps in its arenas) at the end of "
            "the phase holding the peak, minus its value at base, on the rank with the largest measured value",
            "trim released": "VmRSS after training - VmRSS after malloc_trim(0) (max over ranks): freed heap memory "
            "that was still resident",
        },
        "rows": rows,
        "table": table,
        "side_by_side_table": side_by_side,
        "theory_table": theory_table,
        "plot": None if plot_note else str(png),
        "plot_note": plot_note,
    }
    write_json(out, report)
    print(f"\nwrote {out}" + ("" if plot_note else f" and {png}") + f" in {report['total_seconds']:.0f}s")
    return 0 if ok_flatshard else 1


if __name__ == "__main__":
    raise SystemExit(main())
