"""A full checkpoint in the user's sequence: train, save one file at once, then resume from it in fresh processes.

Each contender trains the GPT of ``examples/gpt/model.py`` (same seed, same batches) for ``--steps`` AdamW steps
on ``--world-size`` ranks, then at once (no ``gc``, trim or pause in between) writes one full checkpoint file of
the model and optimizer state, as its users write one:

- ``flatshard``: ``flatshard.save_checkpoint(path, model, opt)`` (streamed: see [Note: streamed full saves]);
  resume: ``flatshard.load_checkpoint(path, model, opt)`` into a fresh sharded model.
- ``flatshard_dict``: ``flatshard.get_state_dict(model, opt)`` then ``torch.save`` on rank 0 (the whole dict
  first, as before streaming); resume as ``flatshard``.
- ``fsdp2``: ``torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True, cpu_offload=True)``
  then ``torch.save`` on rank 0; resume: ``torch.load(mmap=True)`` on every rank and ``set_state_dict``.
- ``ddp``: ``torch.save`` of the replica's ``state_dict()`` and the optimizer's on rank 0; resume: ``torch.load``
  on every rank and ``load_state_dict``.
- ``ddp_fsync`` (a labelled extra row): ``ddp`` followed by ``os.fsync`` of the file, the durability flatshard's
  saves give (they fsync, then rename): the like-for-like write time.
- ``flatshard_trainer``: the same GPT in a LightningModule, trained by ``Trainer(strategy=FlatShardStrategy(...))``
  for the same steps, then ``trainer.save_checkpoint(path)`` (streamed: see [Note: streamed Trainer saves]); resume:
  ``flatshard.load_checkpoint`` of that file into a fresh sharded LightningModule (the loader
  ``fit(ckpt_path=...)`` uses). Its keys carry the module's prefix ``gpt.``; the check strips it.

``--sizes 768x8,1024x12,1280x16`` runs every contender for each ``d_model x n_layer`` (the preset's other fields
kept) and plots rank 0's write peak against the model's size (``full_save_sizes.png``).

Measured: every rank's private memory (``RssAnon + RssFile``), polled every 5 ms by rank 0, during training (the
training peak), during the save (rank 0's write peak) and, in a second set of fresh processes, during the load
(each rank's increase); wall times of the save and of the load; the file's size. Every file is checked against
flatshard's (same tensors to 1e-5) before anything is compared.

    python benchmarks/full_save.py --preset cpu-large
    python benchmarks/full_save.py --preset cpu-large --d-model 1536 --n-layer 16 --n-head 16
    python benchmarks/full_save.py --preset cpu-large --sizes 768x8,1024x12,1280x16

Writes ``docs/bench/full_save_<preset>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_contenders import spawn_ranks, wrap_contender
from bench_measure import MemoryPoller, shmem_kib
from bench_model import MODEL_FIELDS, PRESETS, Block, build_model, make_batches
from bench_output import (
    default_out,
    failed_row,
    fmt,
    machine_info,
    markdown_table,
    pyplot,
    save_figure,
    utc_now,
    write_json,
)
from torch.utils.data import DataLoader

CONTENDERS = ("flatshard", "flatshard_trainer", "flatshard_dict", "fsdp2", "ddp", "ddp_fsync")
TRAINER_PREFIX = "gpt."  # the LightningModule holds the GPT as ``self.gpt``


def _lit_gpt(cfg: dict[str, Any]) -> Any:
    """The benchmark GPT in a LightningModule (imported here: Lightning is needed by this contender only)."""
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = build_model(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            idx, tgt = batch
            return F.cross_entropy(self.gpt(idx).view(-1, cfg["vocab_size"]), tgt.view(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LitGPT()


def _trainer_strategy() -> Any:
    import flatshard

    return flatshard.FlatShardStrategy(auto_wrap_policy={Block}, backward_prefetch="BACKWARD_PRE")


def _wrapped(name: str, cfg: dict[str, Any], rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if name == "flatshard_trainer":  # resumed: a fresh LightningModule sharded as the strategy shards it
        import flatshard

        lit = flatshard.shard(_lit_gpt(cfg), auto_wrap_policy={Block})
        return lit, torch.optim.AdamW(lit.parameters(), lr=1e-4)
    model = build_model(cfg)
    base = "flatshard" if name.startswith("flatshard") else name.removesuffix("_fsync")
    model = wrap_contender(base, model, cfg, rank, torch.device("cpu"), {})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _save(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    rank = dist.get_rank()
    if name == "flatshard":
        import flatshard

        flatshard.save_checkpoint(path, model, opt)
    elif name == "flatshard_dict":
        import flatshard

        state, optim = flatshard.get_state_dict(model, opt)
        if rank == 0:
            torch.save({"state_dict": state, "optimizer_states": [optim]}, path)
    elif name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        state, optim = get_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save({"state_dict": state, "optimizer_states": [optim]}, path)
    else:
        if rank == 0:
            torch.save(
                {"state_dict": model.module.state_dict(), "optimizer_states": [opt.state_dict()]}, path
            )
            if name == "ddp_fsync":  # durable, as flatshard's save is
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    dist.barrier()


def _load(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    if name.startswith("flatshard"):
        import flatshard

        flatshard.load_checkpoint(path, model, opt)
    elif name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        ckpt = torch.load(path, mmap=True, weights_only=True)
        set_state_dict(
            model,
            opt,
            model_state_dict=ckpt["state_dict"],
            optim_state_dict=ckpt["optimizer_states"][0],
            options=StateDictOptions(full_state_dict=True),
        )
        del ckpt
    else:
        ckpt = torch.load(path, weights_only=True)
        model.module.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer_states"][0])
        del ckpt
    dist.barrier()


def _pids(world: int) -> list[int]:
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return pids


def _train_and_save_with_trainer(
    rank: int, world: int, cfg: dict[str, Any], path: str, pids: list[int], shmem: int
) -> dict[str, Any]:
    import lightning as L

    batches = make_batches(cfg, rank, world, torch.device("cpu"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_trainer_strategy(),
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the batches are this rank's already
    )
    out: dict[str, Any] = {}
    with MemoryPoller(pids if rank == 0 else [], shmem) as training:
        trainer.fit(_lit_gpt(cfg), DataLoader(batches, batch_size=None))  # this rank's batches, in order
    with MemoryPoller(pids if rank == 0 else [], shmem) as saving:
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        out["save_s"] = time.perf_counter() - start
    if rank == 0:
        out["training"], out["saving"] = training.result(), saving.result()
    return out


def train_and_save(rank: int, world: int, name: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    pids, shmem = _pids(world), shmem_kib()
    if name == "flatshard_trainer":
        return _train_and_save_with_trainer(rank, world, cfg, path, pids, shmem)
    model, opt = _wrapped(name, cfg, rank)
    batches = make_batches(cfg, rank, world, torch.device("cpu"))
    out: dict[str, Any] = {}
    with MemoryPoller(pids if rank == 0 else [], shmem) as training:
        for idx, tgt in batches:
            F.cross_entropy(model(idx).view(-1, cfg["vocab_size"]), tgt.view(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    dist.barrier()
    with MemoryPoller(pids if rank == 0 else [], shmem) as saving:
        start = time.perf_counter()
        _save(name, model, opt, path)
        out["save_s"] = time.perf_counter() - start
    if rank == 0:
        out["training"], out["saving"] = training.result(), saving.result()
    return out


def resume(rank: int, world: int, name: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    pids, shmem = _pids(world), shmem_kib()
    model, opt = _wrapped(name, cfg, rank)
    # AdamW's state exists before a load, as it does in a resumed run's first step: load into the real thing.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    out: dict[str, Any] = {}
    with MemoryPoller(pids if rank == 0 else [], shmem) as loading:
        start = time.perf_counter()
        _load(name, model, opt, path)
        out["load_s"] = time.perf_counter() - start
    if rank == 0:
        out["loading"] = loading.result()
    return out


def _same_file(path: str, reference: str) -> str | None:
    """Where a contender's file differs from flatshard's (same tensors to 1e-5), or ``None``."""
    mine, theirs = (torch.load(p, mmap=True, weights_only=True) for p in (path, reference))
    state = {k.removeprefix(TRAINER_PREFIX): v for k, v in mine["state_dict"].items()}
    if sorted(state) != sorted(theirs["state_dict"]):
        return "state_dict keys"
    for key, value in theirs["state_dict"].items():
        if not torch.allclose(state[key].float(), value.float(), atol=1e-5, rtol=1e-5):
            return f"state_dict[{key!r}]"

    # Positions in the optimizer's parameter order: flatshard's and DDP's states are keyed by index, FSDP2's by name.
    def ordered(ckpt: dict[str, Any]) -> list[dict[str, Any]]:
        optim = ckpt["optimizer_states"][0]
        return [optim["state"].get(p, {}) for g in optim["param_groups"] for p in g["params"]]

    for i, (entries, other) in enumerate(zip(ordered(theirs), ordered(mine), strict=True)):
        for k, v in entries.items():
            if not torch.allclose(
                torch.as_tensor(other[k]).float(), torch.as_tensor(v).float(), atol=1e-5, rtol=1e-4
            ):
                return f"optimizer state of parameter {i}: {k}"
    return None


def run(cfg: dict[str, Any], contenders: list[str], folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    files: dict[str, str] = {}
    for name in contenders:
        path = str(folder / f"{name}.ckpt")
        print(f"[{name}] train {cfg['steps']} steps, save ...", flush=True)
        try:
            saved = spawn_ranks(
                train_and_save, cfg["world_size"], name, cfg, path, backend="gloo", timeout=3600
            )[0]
            print(f"[{name}] resume in fresh processes ...", flush=True)
            loaded = spawn_ranks(resume, cfg["world_size"], name, cfg, path, backend="gloo", timeout=3600)[0]
        except Exception as err:  # one contender failing must not lose the others' numbers
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            continue
        files[name] = path
        file_mib = os.path.getsize(path) / 2**20
        training_peak = max(saved["training"]["private_peak_mib"])
        write_peak = saved["saving"]["private_peak_mib"][0]
        before_load = loaded["loading"]["private_before_mib"]
        increase = [peak - before for peak, before in zip(loaded["loading"]["private_peak_mib"], before_load)]
        results[name] = {
            "training_peak_mib": training_peak,
            "rank0_training_peak_mib": saved["training"]["private_peak_mib"][0],
            "rank0_write_peak_mib": write_peak,
            "write_s": saved["save_s"],
            "load_s": loaded["load_s"],
            "load_increase_mib": increase,
            "load_before_mib": before_load,
            "file_mib": file_mib,
        }
    reference = files.get("flatshard")
    for name, path in files.items():
        if reference is not None and name != "flatshard":
            results[name]["differs_from_flatshard"] = _same_file(path, reference)
    return results


def _table(results: dict[str, Any]) -> str:
    rows: list[list[str]] = []
    for name, r in results.items():
        if "error" in r:
            rows.append(failed_row(name, r))
            continue
        rows.append(
            [
                name,
                fmt(r["rank0_training_peak_mib"], ".0f"),
                fmt(r["rank0_write_peak_mib"], ".0f"),
                fmt(r["rank0_write_peak_mib"] / r["rank0_training_peak_mib"], ".2f"),
                fmt(r["write_s"], ".2f"),
                " / ".join(fmt(x, ".0f") for x in r["load_increase_mib"]),
                fmt(max(r["load_increase_mib"]) / r["file_mib"], ".2f"),
                fmt(r["load_s"], ".2f"),
                fmt(r["file_mib"], ".0f"),
                str(r.get("differs_from_flatshard") or "same"),
            ]
        )
    return markdown_table(
        [
            "contender",
            "rank-0 training peak MiB",
            "rank-0 write peak MiB",
            "write ÷ training peak",
            "write s",
            "load: increase MiB per rank",
            "largest increase ÷ file",
            "load s",
            "file MiB",
            "file vs flatshard's",
        ],
        rows,
    )


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(d), int(n)) for d, n in (part.split("x") for part in text.split(",") if part)]
    except ValueError:
        raise SystemExit(f"--sizes takes D_MODELxN_LAYER[,...], e.g. 768x8,1024x12; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-large")
    for field in MODEL_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="training steps before the save")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--sizes", default=None, help="D_MODELxN_LAYER list: one run per size, and a plot of them")
    p.add_argument(
        "--folder", type=Path, default=None, help="where the files go (default: a temporary folder)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg: dict[str, Any] = dict(PRESETS[args.preset])
    for field in MODEL_FIELDS:
        if getattr(args, field) is not None:
            cfg[field] = getattr(args, field)
    cfg.update(
        seed=0,
        steps=args.steps,
        warmup=0,
        world_size=args.world_size,
        precision="fp32",
        flatshard_forward_prefetch="off",
        flatshard_backward_prefetch="BACKWARD_PRE",
    )
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    sizes = _sizes(args.sizes) if args.sizes else [(cfg["d_model"], cfg["n_layer"])]
    runs: list[dict[str, Any]] = []
    for d_model, n_layer in sizes:
        size_cfg = dict(cfg, d_model=d_model, n_layer=n_layer)
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            results = run(size_cfg, contenders, Path(folder))
        params = sum(p.numel() for p in build_model(size_cfg).parameters())
        print(
            f"\n{params / 1e6:.0f}M parameters, {cfg['world_size']} ranks, {cfg['steps']} steps before the save\n"
        )
        print(_table(results))
        runs.append({"config": {**size_cfg, "parameters": params}, "results": results})
    name = "full_save_sizes" if args.sizes else f"full_save_{args.preset}"
    out = args.out or default_out(f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "full_save",
        "date": utc_now(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(cfg),
    }
    report.update({"runs": runs} if args.sizes else runs[0])
    write_json(out, report)
    if args.sizes:
        _plot_sizes(
            runs,
            out.with_suffix(".png"),
            f"Full checkpoint write peak by model size, {cfg['world_size']} ranks",
        )
    else:
        params = runs[0]["config"]["parameters"]
        _plot(
            runs[0]["results"],
            out.with_suffix(".png"),
            f"Full checkpoint, {params / 1e6:.0f}M GPT + AdamW, {cfg['world_size']} ranks",
        )
    print(f"wrote {out}")
    return 0


def _plot_sizes(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [
        n for n in runs[0]["results"] if all("error" not in r["results"].get(n, {"error": 1}) for r in runs)
    ]
    params = [r["config"]["parameters"] / 1e6 for r in runs]
    for name in names:
        write = [r["results"][name]["rank0_write_peak_mib"] for r in runs]
        extra = [
            r["results"][name]["rank0_write_peak_mib"] - r["results"][name]["rank0_training_peak_mib"]
            for r in runs
        ]
        left.plot(params, write, marker="o", label=name)
        right.plot(params, extra, marker="o", label=name)
    left.set_xlabel("parameters (M)")
    left.set_ylabel("rank-0 write peak, MiB")
    right.set_xlabel("parameters (M)")
    right.set_ylabel("write peak - training peak, MiB")
    right.axhline(0, color="grey", linewidth=0.5)
    left.legend()
    save_figure(fig, path, title)


def _plot(results: dict[str, Any], path: Path, title: str) -> None:
    try:
        plt = pyplot()
    except ImportError:  # matplotlib is optional: the JSON has the numbers
        return
    names = [n for n, r in results.items() if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [results[n]["rank0_training_peak_mib"] for n in names], label="training peak", alpha=0.5)
    left.bar(names, [results[n]["rank0_write_peak_mib"] for n in names], label="write peak", alpha=0.5)
    left.set_ylabel("rank 0 private MiB")
    left.legend()
    right.bar(names, [max(results[n]["load_increase_mib"]) for n in names])
    right.set_ylabel("largest rank's increase at load, MiB")
    save_figure(fig, path, title)


if __name__ == "__main__":
    sys.exit(main())
