"""A Hugging Face checkpoint loaded into a sharded model, and one written back, against transformers' own way.

Setup (once, kept in ``--workdir`` while the config is the same): a Llama-shaped ``LlamaForCausalLM`` from a config
(no download), random bf16 weights (norms from U(0.5, 1.5)), written by transformers' ``save_pretrained`` as several
``.safetensors`` files; each tensor's float64 sum, and the logits of ``from_pretrained`` on a fixed input.

Loads, per world size of ``--ranks``, each in fresh gloo ranks: ``flatshard load_pretrained`` (``from_config`` on
the meta device, ``flatshard.shard(auto_wrap_policy={LlamaDecoderLayer})``, ``flatshard.load_pretrained``), ``hf
from_pretrained`` (``from_pretrained`` on every rank, then ``shard``) and ``flatshard sync_module_states``
(``from_pretrained`` on rank 0, the meta model elsewhere, ``shard(sync_module_states=True)``). Per rank: the peak RSS
growth over the load (``VmHWM`` reset right before it; the baseline after imports and a warm-up load of the tiny
model), its mapped file pages, the time barrier to barrier, the CPU seconds and the bytes read. Target: growth <=
1.1 x (shard + the largest tensor). Exports: ``flatshard.save_pretrained`` of the loaded model against transformers'
``save_pretrained`` of the unsharded one in one process (fsync timed after it: flatshard's save syncs). Checks first:
the loaded parameters' sums equal the files', the logits the reference's; every written folder holds the source's
tensors bit for bit and loads with ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import contenders as reg
from ..measure import Probe, malloc_trim, median, touch_host_memory
from ..report import Column, Panel
from ..schema import Row
from . import failed, interleaved

_SHAPE = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)
LLAMA: dict[str, dict[str, Any]] = {
    "tiny": dict(zip(_SHAPE, (128, 4, 352, 4, 2)), vocab_size=4096, max_shard_size="1MB"),  # 1.8M parameters
    "llama-1b": dict(
        zip(_SHAPE, (2048, 22, 5632, 32, 4)), vocab_size=32000, max_shard_size="500MB"
    ),  # TinyLlama
}
COMMON = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
PRESETS = tuple(LLAMA)
CONTENDERS = ("flatshard", "hf")
DEFAULT_CONTENDERS = CONTENDERS
LOADS = {"flatshard": ("load_pretrained", "sync_module_states"), "hf": ("from_pretrained",)}
RATIOS = ("peak_growth_mib", "time_s", "cpu_s")
COLUMNS = [
    Column("peak growth MiB/rank", "peak_growth_mib", ".0f"),
    Column("file pages MiB r0", "file_pages_mib", ".0f"),
    Column("shard MiB/rank", "shard_mib", ".0f"),
    Column("target MiB", "target_mib", ".0f"),
    Column("growth ≤ target", "growth_target_met", ""),
    Column("time s", "time_s", ".2f"),
    Column("with fsync s", "time_fsync_s", ".2f"),
    Column("CPU s, max rank", "cpu_s", ".2f"),
    Column("read MiB/rank", "read_mib", ".0f"),
]
PANELS = [Panel("peak RSS growth per rank, MiB", ("peak_growth_mib",)), Panel("seconds", ("time_s",))]
TOKENS = (1, 16)
SLACK = 1.10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--no-export", action="store_true", help="loads only")
    p.add_argument("--touch-host-mib", type=int, default=0, help="touch and free N MiB before each contender")
    p.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "flatshard_bench_pretrained"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    worlds = [int(w) for w in args.ranks.split(",") if w]
    cfg = {
        "preset": args.preset,
        "model": {**COMMON, **LLAMA[args.preset]},
        "world_sizes": worlds,
        "threads": 1,
    }
    cfg.update(export=not args.no_export, touch_host_mib=args.touch_host_mib, workdir=str(args.workdir))
    cfg.update(device="cpu", world_size=max(worlds))
    return cfg, "_".join(
        p
        for p in ("touched" if args.touch_host_mib else "", "n" + "-".join(map(str, worlds)))
        if p and p != "n2-4"
    )


# ----------------------------------------------------------------------------------------------------------
# Setup: the checkpoint, its sums, the reference logits
# ----------------------------------------------------------------------------------------------------------


def _config(preset: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in preset.items() if k != "max_shard_size"})


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.eval()(tokens, use_cache=False).logits.float()


def _tensors(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    return where


def setup_rank(rank: int, world: int, preset: dict[str, Any], folders: list[str]) -> dict[str, Any]:
    """Writes the warm-up (tiny) and the measured checkpoint; their sums, largest tensor, reference logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    for spec, folder in zip(({**COMMON, **LLAMA["tiny"]}, preset), folders):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(spec), dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)  # a norm left at its initial ones shows
        model.save_pretrained(folder, max_shard_size=spec["max_shard_size"])
        del model
    sums, largest = {}, 0
    for key, f in _tensors(Path(folders[1])).items():
        with safe_open(f, framework="pt") as st:
            t = st.get_tensor(key)
            sums[key], largest = float(t.double().sum()), max(largest, t.nbytes)
    model = AutoModelForCausalLM.from_pretrained(folders[1], dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    return {
        "sums": sums,
        "largest_bytes": largest,
        "parameters": params,
        "logits": _logits(model, preset["vocab_size"]),
    }


def _setup(cfg: dict[str, Any]) -> dict[str, Any]:
    key = json.dumps({"version": 2, "model": cfg["model"]}, sort_keys=True)
    root = Path(cfg["workdir"]) / f"{cfg['preset']}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    meta = root / "setup.pt"
    if not meta.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        print(f"[setup] writing the {cfg['preset']} checkpoint to {root}", flush=True)
        folders = [str(root / "warmup"), str(root / "checkpoint")]
        torch.save(reg.run_ranks(setup_rank, 1, cfg["model"], folders, cfg=cfg)[0], meta)
    return {**torch.load(meta, weights_only=False), "root": str(root)}


# ----------------------------------------------------------------------------------------------------------
# Inside the ranks
# ----------------------------------------------------------------------------------------------------------


def _load(method: str, folder: str, rank: int) -> tuple[torch.nn.Module, int | None]:
    """Build, shard and fill the model as ``method`` does; the bytes ``load_pretrained`` read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import flatshard

    if method == "load_pretrained" or (method == "sync_module_states" and rank != 0):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    flatshard.shard(
        model, auto_wrap_policy={LlamaDecoderLayer}, sync_module_states=method == "sync_module_states"
    )
    read = flatshard.load_pretrained(model, folder).bytes_read if method == "load_pretrained" else None
    return model, read


def _measured(region: Any) -> tuple[Any, dict[str, Any]]:
    """``region()`` between barriers, everything freed and trimmed first: its value and the probe's result."""
    gc.collect()
    malloc_trim()
    dist.barrier()
    with Probe() as probe:
        value = region()
        dist.barrier()
    return value, probe.result


def load_rank(rank: int, world: int, method: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    import flatshard  # noqa: F401 (imported before the baseline, as every recipe's imports)

    torch.set_num_threads(1)
    _load(method, f"{root}/warmup", rank)  # code pages, lazy imports, the transport's segments
    (model, read), out = _measured(lambda: _load(method, f"{root}/checkpoint", rank))
    out["shard_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    out["bytes_read"] = out["rchar"] if read is None else read  # rchar misses mapped pages
    names = [n for n, _ in model.named_parameters()]
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    dist.all_reduce(sums)  # every rank's piece
    logits = _logits(model, cfg["model"]["vocab_size"])
    if rank == 0:
        out.update(sums=dict(zip(names, sums.tolist())), logits=logits)
    return out


def export_rank(rank: int, world: int, contender: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Load (flatshard's way, or ``from_pretrained`` unsharded for ``hf``), then write; the write measured."""
    from transformers import AutoModelForCausalLM

    import flatshard

    torch.set_num_threads(1)
    out_dir, limit = f"{root}/export-{contender}-{world}", cfg["model"]["max_shard_size"]

    def write(model: torch.nn.Module, folder: str, max_shard: str) -> None:
        if contender == "hf":
            model.save_pretrained(folder, max_shard_size=max_shard)
        else:
            flatshard.save_pretrained(model, folder, max_shard_size=max_shard)

    def load(folder: str) -> torch.nn.Module:
        if contender == "hf":
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        return _load("load_pretrained", folder, rank)[0]

    write(load(f"{root}/warmup"), out_dir + ".warmup", LLAMA["tiny"]["max_shard_size"])
    model = load(f"{root}/checkpoint")
    _, out = _measured(lambda: write(model, out_dir, limit))
    out["fsync_s"] = 0.0
    if contender == "hf":  # transformers does not sync what it writes
        t0 = time.perf_counter()
        for f in [*Path(out_dir).iterdir(), Path(out_dir)]:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        out["fsync_s"] = time.perf_counter() - t0
    elif rank == 0:  # flatshard writes the weights; the config is the source's
        shutil.copy(f"{root}/checkpoint/config.json", f"{out_dir}/config.json")
    return out


# ----------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------


def _check_load(r0: dict[str, Any], setup: dict[str, Any]) -> str | None:
    sums, expected = r0["sums"], setup["sums"]
    wrong = [
        n
        for n in expected
        if abs(sums.get(n, float("inf")) - expected[n]) > 1e-9 * max(1.0, abs(expected[n]))
    ]
    diff = float((r0["logits"] - setup["logits"]).abs().max())
    if wrong or set(sums) - set(expected) or diff > 1e-2:
        return f"parameter sums differ ({wrong[:3]}) or logits by {diff:.2e}"
    return None


def _check_export(folder: Path, setup: dict[str, Any], source: Path) -> str | None:
    """The written folder against the source, tensor by tensor, then ``from_pretrained`` of it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    mine, theirs = _tensors(folder), _tensors(source)
    if set(mine) != set(theirs):
        return f"tensor names differ: {sorted(set(mine) ^ set(theirs))[:5]}"
    for key in theirs:
        with safe_open(mine[key], framework="pt") as a, safe_open(theirs[key], framework="pt") as b:
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return f"{key} differs"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    diff = float((_logits(model, setup["logits"].shape[-1]) - setup["logits"]).abs().max())
    torch.set_num_threads(threads)
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")) or diff > 1e-2:
        return f"from_pretrained of it: {info}, logits differ by {diff:.2e}"
    return None


def _row(name: str, runs: list[list[dict[str, Any]]], setup: dict[str, Any]) -> Row:
    """The largest growth over repeats (per rank), the median time of the slowest rank."""
    world = len(runs[0])
    growth = [max(run[k]["peak_growth_mib"] for run in runs) for k in range(world)]
    metrics: dict[str, Any] = {
        "peak_growth_mib": growth,
        "file_pages_mib": max(run[0]["file_peak_growth_mib"] for run in runs),
        "time_s": median([max(r["s"] for r in run) for run in runs]),
        "time_fsync_s": median([max(r["s"] + r.get("fsync_s", 0.0) for r in run) for run in runs]),
        "cpu_s": median([max(r["cpu_s"] for r in run) for run in runs]),
        "read_mib": [round(r["bytes_read"] / 2**20) for r in runs[-1]]
        if "bytes_read" in runs[-1][0]
        else None,
    }
    if "shard_mib" in runs[-1][0]:  # a load
        shard = [round(r["shard_mib"], 1) for r in runs[-1]]
        target = [round(SLACK * (s + setup["largest_bytes"] / 2**20), 1) for s in shard]
        metrics.update(
            shard_mib=shard, target_mib=target, growth_target_met=all(g <= t for g, t in zip(growth, target))
        )
    contender, label = name.split(" ", 1)
    return Row(name=name, contender=contender, label=label, metrics=metrics, runs=runs)


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    setup = _setup(cfg)
    root = setup["root"]
    plan = [
        (f"{c} {m} N={w}", load_rank, w, m) for w in cfg["world_sizes"] for c in contenders for m in LOADS[c]
    ]
    if cfg["export"]:
        plan += [
            (f"{c} save_pretrained N={w}", export_rank, w, c)
            for c in contenders
            for w in (cfg["world_sizes"] if c == "flatshard" else [1])
        ]
    steps = {name: (fn, w, arg) for name, fn, w, arg in plan}
    checks: dict[str, str | None] = {}

    def once(name: str) -> list[dict[str, Any]]:
        fn, world, arg = steps[name]
        if cfg["touch_host_mib"]:
            touch_host_memory(cfg["touch_host_mib"])
        ranks = reg.run_ranks(fn, world, arg, cfg, root, cfg=cfg)
        folder = Path(root) / f"export-{arg}-{world}"
        why = (
            _check_load(ranks[0], setup)
            if fn is load_rank
            else _check_export(folder, setup, Path(root) / "checkpoint")
        )
        checks[name] = checks.get(name) or why
        for r in ranks:
            r.pop("sums", None), r.pop("logits", None)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(f"{folder}.warmup", ignore_errors=True)
        return ranks

    runs, errors = interleaved(list(steps), cfg["repeats"], once)
    rows = [
        failed(n.split()[0], errors[n], n.split(" ", 1)[1]) if n in errors else _row(n, runs[n], setup)
        for n in steps
    ]
    for r in rows:  # each checked against the files written by setup
        if r.ok and checks.get(r.name):
            r.check, r.status = (
                {"ok": False, "against": "the checkpoint's files", "why": checks[r.name]},
                "check failed",
            )
        elif r.ok:
            r.check = {"ok": True, "against": "the checkpoint's files"}
    largest = setup["largest_bytes"] / 2**20
    notes = [
        f"{setup['parameters']:,} parameters, bf16; largest tensor {largest:.0f} MiB; files in the page cache"
    ]
    return rows, notes


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    """Per world size: flatshard's load over the other loads; flatshard's export over transformers'."""
    pairs = []
    for r in rows:
        world = r.name.rsplit("N=", 1)[1]
        if r.label.startswith("save_pretrained") and r.contender == "flatshard":
            pairs.append((r.name, "hf save_pretrained N=1"))
        elif not r.label.startswith(("load_pretrained", "save_pretrained")):
            pairs.append((f"flatshard load_pretrained N={world}", r.name))
    return pairs
