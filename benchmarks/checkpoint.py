"""Time and memory to gather the full model + optimizer state on rank 0: flatshard vs torch FSDP1 / FSDP2,
in the user's sequence (right after training) and, as labelled extra rows, warm repeats, in one run.

Every contender builds the same GPT (``examples/gpt/model.py``) from the same seed on ``--world-size``
ranks (default 2), in freshly spawned processes with a fresh process group (gloo on CPU), shards it,
creates ``AdamW(lr=1e-4)`` and trains ``--train-steps`` steps (default 6) on fixed random batches. Then:

1. **cold** (the user's sequence): the first gather, right after the last training step and a barrier, with
   nothing in between (no ``gc``, no trim) and nothing gathered before it in the process group (each contender
   runs in its own fresh processes);
2. ``--warmup`` untimed gathers (default 0), then **warm** (extra rows): ``--repeats`` gathers (default 3;
   medians reported), each after freeing the previous result and ``gc.collect()``.

``--malloc-trim`` (a labelled variant, off by default) calls glibc's ``malloc_trim(0)`` before every gather,
the first one included: conditions a user's run would not create.

Each gather is one call that returns the full, consolidated model and optimizer state on rank 0 (other
ranks get empty dicts), offloaded to CPU:

- ``flatshard``: ``flatshard.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)``
- ``fsdp1``: ``model.state_dict()`` + ``FSDP.optim_state_dict(model, opt)`` under
  ``FSDP.state_dict_type(FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))``
- ``fsdp2``: ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt,
  options=StateDictOptions(full_state_dict=True, cpu_offload=True))``

Measured per gather:

* **time**: wall time of the call on each rank (rank 0's is reported).
* **private memory per rank**: ``RssAnon + RssFile`` from ``/proc/<pid>/status`` (resident pages less
  ``RssShmem``, i.e. without shared-memory pages), sampled every 5 ms by a poller thread in rank 0 for every
  rank's pid, from right before the call until it returned: the value before and the peak. It counts the
  shared libraries' file pages in every rank (alike for every contender); ``smaps_rollup``'s exact
  ``Private_Clean + Private_Dirty`` (tens of ms per read) is read before and after the call as a check.
* **node total**: the peak over the same samples of ``sum over ranks of private memory + (Shmem of
  /proc/meminfo - Shmem when the contender's ranks started)``: shared-memory pages (``/dev/shm``
  segments, shared mappings) counted once, however many ranks map them. Other processes' shared memory
  changing meanwhile would show up in it (the host is assumed otherwise idle).
* **VmHWM extra** per rank: ``VmHWM`` reset with ``echo 5 > /proc/self/clear_refs`` right before the call,
  minus ``VmRSS`` before it (exact peak, but shared pages count in every rank that maps them); where
  the reset is not permitted, a 5 ms ``VmRSS`` sampler.
* **full state size**: the bytes of all tensors of the model + optimizer state on rank 0 (each storage
  counted once: a tied weight appears under two keys).

Then **save** on rank 0 (``flatshard.checkpoint.files.atomic_save`` for flatshard, which also fsyncs;
``torch.save`` for the peers), **load** on every rank (``torch.load(path, map_location="cpu", mmap=True)``)
and, for flatshard, ``flatshard.set_state_dict`` on every rank from the loaded dict. **Correctness**: after
all contenders ran, the main process reads the saved files back and checks that the model state dicts
have the same keys and ``torch.equal`` tensors, and that the AdamW ``exp_avg`` tensors are equal
(FSDP1/FSDP2's FQN-keyed optimizer state is mapped to flatshard's index-keyed one through the order of
``model.named_parameters()``).

Cold numbers depend on the host: on a VM, the first touch of memory not used recently costs a host
fault per page (~5x a warm fault on the VM of ``docs/benchmarks.md``), and contenders run one after
another, so a later one may find memory that an earlier one freed still backed. ``--touch-host-mib N``
touches and frees N MiB right before each contender, so that every one starts alike.

    python benchmarks/checkpoint.py --preset tiny          # smoke run, seconds
    python benchmarks/checkpoint.py --contenders flatshard,fsdp1   # cpu-large: 203M parameters, minutes

Writes ``docs/bench/checkpoint_<preset>.json`` and ``.png`` (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from bench_checks import (
    check_correctness,
    crash_report,
    reference_param_names,
)
from bench_contenders import spawn_ranks
from bench_measure import (
    MIB,
    touch_host_memory,
)
from bench_model import MODEL_FIELDS
from bench_model import PRESETS as STEP_TIME_PRESETS
from bench_output import (
    default_out,
    failed_row,
    fmt,
    indent,
    machine_info,
    markdown_table,
    pyplot,
    save_figure,
    utc_now,
    write_json,
)
from checkpoint_ranks import run_contender

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layer=2, n_head=4, batch_size=2, seq_len=32, vocab_size=512, device="cpu"),
    # GPT-2-medium width, half its depth, GPT-2 vocabulary: 203M parameters (the "168M CPU preset").
    "cpu-large": dict(STEP_TIME_PRESETS["cpu-large"]),
}
ALL_CONTENDERS = ("flatshard", "fsdp1", "fsdp2")
DESCRIPTIONS = {
    "flatshard": "flatshard.get_state_dict(full=True, rank0_only=True, cpu_offload=True); "
    "model: flatshard.shard FULL_SHARD, auto_wrap_policy={Block}",
    "fsdp1": "FSDP1 FULL_STATE_DICT model.state_dict() + FSDP.optim_state_dict (rank0_only, offload_to_cpu); "
    "model: FullyShardedDataParallel, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp2": "torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True, "
    "cpu_offload=True); model: fully_shard per Block then root",
}
SAVE_CALLS = {
    "flatshard": "flatshard.checkpoint.files.atomic_save (temp file, fsync, rename)",
    "fsdp1": "torch.save",
    "fsdp2": "torch.save",
}
TARGET_TIME_RATIO = 0.15  # flatshard gather time <= 0.15x FSDP1's, cold and warm
TARGET_MEM_RATIO = 1.0  # flatshard rank-0 peak private memory and node total <= FSDP1's
PHASES = ("cold", "warm")


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def _phase(per_rank: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    """Rank 0's view of one phase (medians over the warm repeats): time, memory, VmHWM per rank."""
    runs = [r[phase] if phase == "warm" else [r[phase]] for r in per_rank]  # per rank, per gather
    r0 = runs[0]

    def med(key: str, i: int | None = None) -> float:
        return statistics.median(m[key] if i is None else m[key][i] for m in r0)

    ranks = range(len(per_rank))
    out: dict[str, Any] = {
        "gather_s": med("s"),
        "gather_s_per_repeat_per_rank": [[round(m["s"], 4) for m in rr] for rr in runs],
        "gather_s_max_over_ranks": statistics.median(
            max(ms) for ms in zip(*[[m["s"] for m in rr] for rr in runs])
        ),
        "private_before_mib_per_rank": [med("private_before_mib", i) for i in ranks],
        "private_peak_mib_per_rank": [med("private_peak_mib", i) for i in ranks],
        "node_before_mib": med("node_before_mib"),
        "node_peak_mib": med("node_peak_mib"),
        "hwm_extra_mib_per_rank": [statistics.median(m["hwm_extra_mib"] for m in rr) for rr in runs],
        "retained_mib_per_rank": [statistics.median(m["retained_mib"] for m in rr) for rr in runs],
        "smaps_private_before_mib_per_rank": [rr[-1]["smaps_private_before_mib"] for rr in runs],
        "smaps_private_after_mib_per_rank": [rr[-1]["smaps_private_after_mib"] for rr in runs],
        "poller_samples": [m["samples"] for m in r0],
    }
    out["rank0_private_peak_mib"] = out["private_peak_mib_per_rank"][0]
    out["rank0_private_extra_mib"] = out["rank0_private_peak_mib"] - out["private_before_mib_per_rank"][0]
    out["node_extra_mib"] = out["node_peak_mib"] - out["node_before_mib"]
    return out


def summarize(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    res: dict[str, Any] = {
        "status": "ok",
        "description": DESCRIPTIONS[name],
        "num_params": r0["num_params"],
        "loss_after_step": r0["loss"],
        "memory_method": r0["memory_method"],
        **{phase: _phase(per_rank, phase) for phase in PHASES},
        "full_state_bytes": r0["full_state_bytes"],
        "full_state_bytes_all_entries": r0["full_state_bytes_all_entries"],
        "full_state_tensors": r0["full_state_tensors"],
        "model_state_keys": r0["model_state_keys"],
        "optim_state_entries": r0["optim_state_entries"],
        "other_ranks_got_empty_state": all(r.get("rank_nonzero_state_empty") for r in per_rank[1:]),
        "save_call": SAVE_CALLS[name],
        "save_s": r0["save_s"],
        "file_bytes": r0["file_bytes"],
        "load_s_per_rank": [r["load_s"] for r in per_rank],
        "load_s": r0["load_s"],
        "setup_s": max(r["setup_s"] for r in per_rank),
    }
    if "save_plain_torch_save_s" in r0:
        res["save_plain_torch_save_s"] = r0["save_plain_torch_save_s"]
    if name == "flatshard":
        res["set_state_dict_s_per_rank"] = [r["set_state_dict_s"] for r in per_rank]
        res["set_state_dict_s"] = max(res["set_state_dict_s_per_rank"])
        res["roundtrip_equal"] = r0.get("roundtrip_equal")
    if name == "fsdp1":
        res["fsdp1_offload_to_cpu"] = r0["fsdp1_offload_to_cpu"]
    return res


def compute_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """flatshard / peer per phase (< 1: flatshard is faster / needs less memory), with the targets."""
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    if "flatshard" not in ok:
        return {}
    fs = ok["flatshard"]
    ratios: dict[str, dict[str, Any]] = {}
    for peer, r in ok.items():
        if peer == "flatshard":
            continue
        for phase in PHASES:
            a, b = fs[phase], r[phase]
            entry = {
                "gather_time_ratio": _ratio(a["gather_s"], b["gather_s"]),
                "rank0_private_peak_ratio": _ratio(a["rank0_private_peak_mib"], b["rank0_private_peak_mib"]),
                "node_peak_ratio": _ratio(a["node_peak_mib"], b["node_peak_mib"]),
                "rank0_private_extra_ratio": _ratio(
                    a["rank0_private_extra_mib"], b["rank0_private_extra_mib"]
                ),
                "node_extra_ratio": _ratio(a["node_extra_mib"], b["node_extra_mib"]),
            }
            entry["meets_time_target"] = _le(entry["gather_time_ratio"], TARGET_TIME_RATIO)
            entry["meets_memory_target"] = _le(entry["rank0_private_peak_ratio"], TARGET_MEM_RATIO) and _le(
                entry["node_peak_ratio"], TARGET_MEM_RATIO
            )
            ratios[f"flatshard/{peer} {phase}"] = entry
        ratios[f"flatshard/{peer} cold"]["save_time_ratio"] = _ratio(fs["save_s"], r["save_s"])
    return ratios


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _le(x: float | None, limit: float) -> bool:
    return x is not None and x <= limit


def format_table(
    results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], trimmed: bool = False
) -> str:
    headers = [
        "contender",
        "phase",
        "gather s",
        "r0 private MiB before / peak",
        "r1 private MiB peak",
        "node MiB before / peak",
        "VmHWM extra MiB r0 / r1",
        "flatshard/this: time",
        "r0 private peak",
        "node peak",
    ]
    rows = []
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append(failed_row(name, r))
            continue
        for phase in PHASES:
            p = r[phase]
            rat = ratios.get(f"flatshard/{name} {phase}", {})
            ref = name == "flatshard"
            rows.append(
                [
                    name,
                    ("after training" + (", malloc_trim first" if trimmed else ""))
                    if phase == "cold"
                    else f"warm repeats (median of {len(p['poller_samples'])})",
                    fmt(p["gather_s"], ".3f"),
                    f"{p['private_before_mib_per_rank'][0]:.0f} / {p['rank0_private_peak_mib']:.0f}",
                    " / ".join(fmt(x, ".0f") for x in p["private_peak_mib_per_rank"][1:]),
                    f"{p['node_before_mib']:.0f} / {p['node_peak_mib']:.0f}",
                    " / ".join(fmt(x, ".0f") for x in p["hwm_extra_mib_per_rank"]),
                    *(
                        ["1 (ref)"] * 3
                        if ref
                        else [
                            fmt(rat.get(k), ".3f" if k == "gather_time_ratio" else ".2f")
                            for k in ("gather_time_ratio", "rank0_private_peak_ratio", "node_peak_ratio")
                        ]
                    ),
                ]
            )
    return markdown_table(headers, rows)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    ok = {k: v for k, v in results.items() if v.get("status") == "ok"}
    names = list(ok)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(9, 2.5 * len(names) + 4), 4.5))
    x = list(range(len(names)))
    w = 0.38
    for j, (phase, color) in enumerate((("cold", "tab:blue"), ("warm", "tab:orange"))):
        xs = [i + (j - 0.5) * w for i in x]
        vals = [ok[n][phase]["gather_s"] for n in names]
        ax_t.bar(xs, vals, w, color=color, label=phase + (" (median)" if phase == "warm" else ""))
        for xi, v in zip(xs, vals):
            ax_t.annotate(f"{v:.2f}s", (xi, v), ha="center", va="bottom", fontsize=7)
    if "fsdp1" in ok and "flatshard" in ok:
        for j, phase in enumerate(PHASES):
            target = TARGET_TIME_RATIO * ok["fsdp1"][phase]["gather_s"]
            ax_t.hlines(target, -0.5, len(names) - 0.5, color=("tab:blue", "tab:orange")[j], ls="--", lw=1)
        ax_t.plot([], [], "k--", lw=1, label=f"target: {TARGET_TIME_RATIO}x FSDP1 (per phase)")
    ax_t.set_ylabel("seconds, lower is better")
    ax_t.set_title("gather full model + AdamW state on rank 0", fontsize=9)
    ax_t.legend(fontsize=7)
    w = 0.2
    bars = (
        ("cold", "rank0_private_peak_mib", "tab:blue", "rank-0 private peak, cold"),
        ("warm", "rank0_private_peak_mib", "tab:orange", "rank-0 private peak, warm"),
        ("cold", "node_peak_mib", "tab:cyan", "node total peak, cold"),
        ("warm", "node_peak_mib", "tab:red", "node total peak, warm"),
    )
    for j, (phase, key, color, label) in enumerate(bars):
        ax_m.bar(
            [i + (j - 1.5) * w for i in x], [ok[n][phase][key] for n in names], w, color=color, label=label
        )
    ax_m.set_ylabel("MiB (private: RssAnon+RssFile; node: shared counted once)")
    ax_m.set_title("peak memory during the gather", fontsize=9)
    ax_m.legend(fontsize=7)
    for ax in (ax_t, ax_m):
        ax.set_xticks(x)
        ax.set_xticklabels(names)
        ax.grid(axis="y", alpha=0.3)
    failed = [k for k, v in results.items() if v.get("status") != "ok"]
    if failed:
        title += f"  [failed: {', '.join(failed)}]"
    save_figure(fig, path, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-large", help="model preset")
    for field in MODEL_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument(
        "--contenders",
        default=",".join(ALL_CONTENDERS),
        help=f"comma-separated, run in this order; choices: {', '.join(ALL_CONTENDERS)}",
    )
    p.add_argument("--repeats", type=int, default=3, help="warm gathers after the cold one (median reported)")
    p.add_argument("--warmup", type=int, default=0, help="untimed gathers between the cold and the warm ones")
    touch = (
        "before each contender, touch and free this much memory (0: no; see bench_measure.touch_host_memory)"
    )
    p.add_argument("--touch-host-mib", type=int, default=0, help=touch)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    hwm = "VmHWM extra: after a clear_refs reset if permitted (auto), else a 5 ms VmRSS sampler thread"
    p.add_argument("--memory-method", choices=["auto", "vmhwm", "sampler"], default="auto", help=hwm)
    p.add_argument(
        "--fsdp1-offload",
        choices=["auto", "on", "off"],
        default="auto",
        help="FSDP1 offload_to_cpu; auto: True, and if that run fails (torch 2.13 segfaults on CPU),\n"
        "run FSDP1 again in fresh processes with False",
    )
    trim = "call glibc malloc_trim(0) before each gather, the first included (a variant; off: the user's sequence)"
    p.add_argument("--malloc-trim", action="store_true", help=trim)
    p.add_argument("--train-steps", type=int, default=6, help="training steps before the first gather")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a contender may run")
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes next to it")
    p.add_argument(
        "--tmpdir", type=Path, default=None, help="where the checkpoints go (default: a new temp dir)"
    )
    p.add_argument("--keep-files", action="store_true", help="do not delete the saved checkpoints")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(PRESETS[args.preset])
    overrides = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    cfg.update(overrides)
    if cfg["device"] != "cpu":
        raise SystemExit("this benchmark runs on CPU (gloo) only")
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    cfg.update(
        preset=args.preset,
        overrides=overrides,
        world_size=args.world_size,
        seed=args.seed,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        memory_method=args.memory_method,
        malloc_trim=args.malloc_trim,
        train_steps=args.train_steps,
        fsdp1_offload=args.fsdp1_offload,
        touch_host_mib=args.touch_host_mib,
        optimizer=f"AdamW(lr=1e-4), other defaults; {args.train_steps} training steps before the first gather",
        precision="fp32",
    )
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join(ALL_CONTENDERS)}")
    ws = cfg["world_size"]
    out = args.out or default_out(f"checkpoint_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tmpdir is not None:
        args.tmpdir.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix="flatshard_ckpt_bench_", dir=args.tmpdir))
    cfg["tmpdir"] = str(tmpdir)

    report: dict[str, Any] = {
        "benchmark": "checkpoint",
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(cfg),
        "config": cfg,
        "contenders": contenders,
        "targets": {
            "flatshard_gather_time_over_fsdp1_cold_and_warm": f"<= {TARGET_TIME_RATIO}",
            "flatshard_rank0_private_peak_and_node_peak_over_fsdp1": f"<= {TARGET_MEM_RATIO}",
        },
        "results": {},
        "ratios": {},
    }
    print(
        f"preset {args.preset}: d_model={cfg['d_model']} n_layer={cfg['n_layer']} n_head={cfg['n_head']} "
        f"vocab={cfg['vocab_size']} seq={cfg['seq_len']} | {ws} ranks, gloo, cpu, fp32, "
        f"{cfg['threads']} thread(s)/rank | repeats {cfg['repeats']} | checkpoints in {tmpdir}",
        flush=True,
    )
    param_names: list[str] | None = None
    try:
        for name in contenders:
            t0 = time.perf_counter()
            print(f"{name}: {DESCRIPTIONS[name]} ...", flush=True)
            if cfg["touch_host_mib"]:  # see touch_host_memory
                print(
                    f"    touched {cfg['touch_host_mib']} MiB in {touch_host_memory(cfg['touch_host_mib']):.2f}s"
                )
            attempts = [cfg]
            if name == "fsdp1" and cfg["fsdp1_offload"] == "auto":
                attempts = [dict(cfg, fsdp1_offload="on"), dict(cfg, fsdp1_offload="off")]
            earlier_errors: list[str] = []
            res = None
            for attempt in attempts:
                try:
                    per_rank = spawn_ranks(
                        run_contender, ws, name, attempt, backend="gloo", timeout=args.timeout
                    )
                    res = summarize(name, per_rank)
                    break
                except Exception as err:  # record it, then the fallback or the next contender
                    msg = f"{type(err).__name__}: {err}"
                    crash = crash_report(attempt, name, ws)
                    if crash:
                        msg = f"{crash}\n{msg}"
                    earlier_errors.append(msg)
                    more = " (retrying with offload_to_cpu=False)" if attempt is not attempts[-1] else ""
                    print(
                        f"    FAILED after {time.perf_counter() - t0:.1f}s{more}:\n{indent(msg)}", flush=True
                    )
            if res is None:
                report["results"][name] = {
                    "status": "failed",
                    "description": DESCRIPTIONS[name],
                    "error": earlier_errors[-1],
                    "earlier_errors": earlier_errors[:-1],
                }
                continue
            if name == "fsdp1":
                res["fsdp1_offload_requested"] = cfg["fsdp1_offload"]
                res["fsdp1_offload_error"] = earlier_errors[-1] if earlier_errors else None
            if name == "flatshard" or param_names is None:
                param_names = per_rank[0]["param_names"]
            res["loadavg_after_run"] = [round(x, 2) for x in os.getloadavg()]
            report["results"][name] = res
            print(
                f"    done in {time.perf_counter() - t0:.1f}s: gather cold {res['cold']['gather_s']:.3f}s, warm "
                f"{res['warm']['gather_s']:.3f}s {res['warm']['gather_s_per_repeat_per_rank'][0]}, rank-0 private "
                f"peak cold / warm {res['cold']['rank0_private_peak_mib']:.0f} / "
                f"{res['warm']['rank0_private_peak_mib']:.0f} MiB, node peak {res['cold']['node_peak_mib']:.0f} / "
                f"{res['warm']['node_peak_mib']:.0f} MiB, state {res['full_state_bytes'] / MIB:.0f} MiB, "
                f"save {res['save_s']:.2f}s, load {res['load_s']:.3f}s"
                + (f", set_state_dict {res['set_state_dict_s']:.3f}s" if "set_state_dict_s" in res else ""),
                flush=True,
            )
        reference_names = reference_param_names(cfg)
        try:
            report["correctness"] = check_correctness(
                contenders, tmpdir, param_names or reference_names, reference_names
            )
        except Exception:
            report["correctness"] = {"all_equal": None, "error": traceback.format_exc()}
    finally:
        if args.keep_files:
            print(f"checkpoints kept in {tmpdir}")
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)

    report["ratios"] = compute_ratios(report["results"])
    report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    notes = []
    results = report["results"]
    methods = sorted({r.get("memory_method") for r in results.values() if r.get("status") == "ok"})
    notes.append(
        "private memory: RssAnon + RssFile of /proc/<pid>/status per rank; node total: their sum + growth of "
        "/proc/meminfo Shmem since the contender's ranks started (shared pages once); sampled every 5 ms by "
        f"a poller thread in rank 0 during each gather. VmHWM extra ({', '.join(methods)}): see the docstring"
    )
    f1 = results.get("fsdp1", {})
    if f1.get("status") == "ok" and not f1.get("fsdp1_offload_to_cpu"):
        err = (f1.get("fsdp1_offload_error") or "").strip().splitlines()
        notes.append(
            "fsdp1 ran with offload_to_cpu=False (model and optimizer configs)"
            + (
                f" because the run with offload_to_cpu=True failed: {err[0][:300] if err else '?'}"
                if f1.get("fsdp1_offload_error")
                else ""
            )
            + "; on CPU the gathered tensors are CPU tensors either way"
        )
    fs = results.get("flatshard", {})
    if fs.get("status") == "ok":
        notes.append(
            "save: flatshard uses atomic_save (temp file + fsync + rename), the peers plain torch.save; "
            f"flatshard's state with plain torch.save took {fs['save_plain_torch_save_s']:.2f}s"
        )
        if fs.get("roundtrip_equal") is False:
            notes.append("flatshard: gathering after set_state_dict did NOT give back the loaded state")
    sizes = {n: r for n, r in results.items() if r.get("status") == "ok"}
    if len({r["full_state_bytes"] for r in sizes.values()}) > 1:  # the peers copy the tied weight twice
        notes.append(
            "full state MiB (storages once / every entry): "
            + ", ".join(
                f"{n} {r['full_state_bytes'] / MIB:.0f} / {r['full_state_bytes_all_entries'] / MIB:.0f}"
                for n, r in sizes.items()
            )
        )
    corr = report.get("correctness", {})
    if corr.get("all_equal") is False:
        notes.append("correctness: the contenders' states differ (see `correctness` in the JSON)")
    for n, r in sizes.items():
        if r["loadavg_after_run"][0] > ws + 0.75:
            notes.append(
                f"{n}: load average {r['loadavg_after_run'][0]:.1f} after its run: other processes ran"
            )
    report["notes"] = notes

    table = format_table(results, report["ratios"], cfg["malloc_trim"])
    report["table"] = table
    print()
    print(table)
    if report["ratios"]:
        print("\nratios (flatshard / peer; < 1 means flatshard is faster or needs less memory):")
        for key, r in report["ratios"].items():
            print(
                f"  {key:<19} gather time x{fmt(r['gather_time_ratio'], '.3f')} (target <= {TARGET_TIME_RATIO}: "
                f"{'met' if r['meets_time_target'] else 'NOT met'}), rank-0 private peak "
                f"x{fmt(r['rank0_private_peak_ratio'], '.2f')}, node peak x{fmt(r['node_peak_ratio'], '.2f')} "
                f"(target <= {TARGET_MEM_RATIO}: {'met' if r['meets_memory_target'] else 'NOT met'}); extra over "
                f"before: rank 0 x{fmt(r['rank0_private_extra_ratio'], '.2f')}, node x{fmt(r['node_extra_ratio'], '.2f')}"
            )
    if corr:
        print(
            "\ncorrectness (model keys + tensors and AdamW exp_avg, torch.equal, "
            f"vs {corr.get('reference')}): {corr.get('all_equal')}"
        )
        for pair, e in corr.get("pairs", {}).items():
            print(
                f"  {pair}: model keys {e['model_same_keys']}, model tensors {e['model_tensors_equal']}, "
                f"exp_avg {e['exp_avg_equal']}, exp_avg_sq {e['exp_avg_sq_equal']}, steps {e['step_values']}"
            )
    for n in notes:
        print("note:", n)
    write_json(out, report, default=str)
    png = out.with_suffix(".png")
    title = (
        f"checkpoint {args.preset}: d{cfg['d_model']} L{cfg['n_layer']} V{cfg['vocab_size']}, "
        f"{ws} ranks gloo CPU fp32, torch {torch.__version__}, {report['date'][:10]}"
    )
    try:
        plot(results, png, title)
    except Exception as err:  # the JSON is the primary output
        print(f"plot failed: {type(err).__name__}: {err}")
    else:
        print(f"\nwrote {out} and {png}")
    ok = [r for r in results.values() if r.get("status") == "ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
