"""One AdamW step in host memory on a rank's shard of a Llama-shaped model: naive, foreach, fused, flatshard's offload.

What ``cpu_offload="optimizer"`` runs every step, beside the ways to step CPU tensors. A preset is a model shape
and a world size; the shard is this rank's piece of every parameter (embedding, each block's attention and MLP
matrices and norms), ``1/world`` of each, as flatshard lays them out. Each contender runs in a fresh process,
``--threads`` torch threads (default: every core, as one rank per socket has):

- ``adamw_naive``: ``torch.optim.AdamW(foreach=False)`` on one CPU tensor per piece (the per-tensor loop);
- ``adamw_foreach``: ``foreach=True``;
- ``adamw_fused``: ``fused=True``, torch's fused CPU kernel;
- ``flatshard_offload_optimizer``: the pieces as parameters of a module sharded with ``cpu_offload="optimizer"``
  (one rank, one unit per block), ``AdamW(fused=True)``: ``optimizer.step()`` with flatshard's hooks, that is the
  host step plus, on a CPU device, the copies between the shards and the host copies. Its row ``grad copy in
  step`` also copies the gradient shards at the step (on a GPU that copy starts in backward).

Every contender steps the same values with the same gradients; each one's weights and ``exp_avg_sq`` after the
steps are checked against ``adamw_naive``'s before any time is compared. The ratios are each row over
``adamw_naive``: the issue's target on a GPU is the offloaded step at least 3x faster than the naive one.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.nn as nn

from .. import contenders as reg
from ..measure import median
from ..report import Column, Panel
from ..schema import Row
from . import check_against, failed, interleaved

# (d_model, ffn, layers, vocab, world): Llama-shaped models and the ranks they are sharded over
SHAPES = {
    "llama-1b-8": (2048, 8192, 16, 32000, 8),
    "llama-8b-8": (4096, 14336, 32, 128256, 8),
    "tiny": (64, 256, 2, 512, 2),
}
PRESETS = tuple(SHAPES)
CONTENDERS = ("adamw_naive", "adamw_foreach", "adamw_fused", "flatshard_offload_optimizer")
DEFAULT_CONTENDERS = CONTENDERS
REFERENCE = "adamw_naive"
RATIOS = ("step_s",)
COLUMNS = [
    Column("elements (shard)", "numel", ",d"),
    Column("pieces", "pieces", "d"),
    Column("step s", "step_s", ".3f"),
    Column("of it the optimizer's own s", "kernel_s", ".3f"),
    Column("naive ÷ this (speed-up)", "÷step_s", ".2f"),
    Column("GB/s (7 x 4 B per element)", "gb_s", ".2f"),
]
PANELS = [Panel("seconds per AdamW step (median)", ("step_s", "kernel_s"))]
LR, WEIGHT_DECAY = 1e-3, 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)"
    )


def configure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit("--steps and --threads must be >= 1, --warmup >= 0")
    d, ffn, layers, vocab, world = SHAPES[args.preset]
    cfg = {"d_model": d, "ffn": ffn, "layers": layers, "vocab": vocab, "world": world}
    cfg.update(steps=args.steps, warmup=args.warmup, threads=args.threads, device="cpu", world_size=1)
    return cfg, ""


def piece_sizes(cfg: dict[str, Any]) -> list[list[int]]:
    """This rank's piece of each parameter, by unit: the root (embedding, final norm), then each block."""
    d, ffn, world = cfg["d_model"], cfg["ffn"], cfg["world"]
    block = [d * d] * 4 + [d * ffn] * 3 + [d] * 2  # q, k, v, o; gate, up, down; two norms
    return [
        [math.ceil(n / world) for n in sizes] for sizes in [[cfg["vocab"] * d, d], *[block] * cfg["layers"]]
    ]


def _values(numel: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * scale


class _Unit(nn.Module):
    """One unit's pieces as 1-D parameters; its forward makes every gradient one (the values are set after)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.pieces = nn.ParameterList([nn.Parameter(t) for t in tensors])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(p.sum() for p in self.pieces)


class _Shard(nn.Module):
    def __init__(self, units: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.root = nn.ParameterList([nn.Parameter(t) for t in units[0]])
        self.blocks = nn.ModuleList(_Unit(u) for u in units[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + sum(p.sum() for p in self.root)
        for block in self.blocks:
            x = block(x)
        return x


def _flatshard(units: list[list[torch.Tensor]], grads: list[torch.Tensor]) -> tuple[Any, list[nn.Parameter]]:
    import flatshard

    model = flatshard.shard(_Shard(units), auto_wrap_policy={_Unit}, cpu_offload="optimizer")
    params = [p for p in model.root] + [p for b in model.blocks for p in b.pieces]
    model(torch.zeros(())).backward()  # gradients are views of the units' gradient shards, as in training
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad.copy_(g)  # type: ignore[union-attr]
    return model, params


def step_rank(rank: int, world: int, name: str, copy_in_step: bool, cfg: dict[str, Any]) -> dict[str, Any]:
    reg.rank_device(cfg, rank)  # the thread count
    sizes = piece_sizes(cfg)
    flat = [n for unit in sizes for n in unit]
    units, grads, k = [], [], 0
    for unit in sizes:
        units.append([_values(n, 2 * (k + i), 0.02) for i, n in enumerate(unit)])
        grads += [_values(n, 2 * (k + i) + 1, 1e-3) for i, n in enumerate(unit)]
        k += len(unit)
    if name == "flatshard_offload_optimizer":
        model, params = _flatshard(units, grads)
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    else:
        model, params = None, [nn.Parameter(t) for unit in units for t in unit]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **reg.get(name).options["adamw"])
    del units, grads
    # the optimizer's own step: between its own step hooks, which run inside flatshard's global ones
    marks: list[float] = []
    opt.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))
    opt.register_step_post_hook(lambda *_: marks.append(time.perf_counter()))
    times, kernel = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if copy_in_step:  # the gradient shards were "written" since backward: the step copies them again
            for s in flatshard_units(model):
                for h in s.handles:
                    torch.autograd.graph.increment_version(h.sharded_grad())
        t0 = time.perf_counter()
        opt.step()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
            kernel.append(marks[-1] - marks[-2])
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    second = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
    return {
        "step_s": times,
        "kernel_s": kernel,
        "numel": sum(flat),
        "pieces": len(flat),
        "weights_sum": weights.double().sum().item(),
        "weights_sample": weights[:: max(1, weights.numel() // 4096)].clone(),
        "second_sum": second.double().sum().item(),
    }


def flatshard_units(model: Any) -> list[Any]:
    if model is None:
        return []
    from flatshard.engine import unit_states

    return unit_states(model)


def run(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[Row], list[str]]:
    jobs = {c: (c, False) for c in contenders}
    if "flatshard_offload_optimizer" in contenders:
        jobs["flatshard_offload_optimizer grad-copy-in-step"] = ("flatshard_offload_optimizer", True)
    runs, errors = interleaved(
        list(jobs), cfg["repeats"], lambda job: reg.run_ranks(step_rank, 1, *jobs[job], cfg, cfg=cfg)[0]
    )
    rows, values = [], {}
    for job, (name, copy_in_step) in jobs.items():
        tag = "grad-copy-in-step" if copy_in_step else ""
        if job in errors:
            rows.append(failed(name, errors[job], tag))
            continue
        done = runs[job]
        step_s = median([t for r in done for t in r["step_s"]])
        numel = done[0]["numel"]
        metrics = {
            "step_s": step_s,
            "kernel_s": median([t for r in done for t in r["kernel_s"]]),
            "numel": numel,
            "pieces": done[0]["pieces"],
            "gb_s": 7 * 4 * numel / step_s / 1e9 if step_s else None,
        }
        values[job] = {k: done[0][k] for k in ("weights_sum", "weights_sample", "second_sum")}
        rows.append(
            Row(
                name=job,
                contender=name,
                label=tag,
                metrics=metrics,
                runs=[{k: r[k] for k in ("step_s", "kernel_s")} for r in done],
            )
        )

    def close(row: Row, ref: Row) -> str | None:
        a, b = values[row.name], values[ref.name]
        sample = (a["weights_sample"] - b["weights_sample"]).abs().max().item()
        if sample > 1e-5:
            return f"weights differ from {ref.name}'s by {sample:.2e}"
        for key in ("weights_sum", "second_sum"):
            if abs(a[key] - b[key]) > 1e-5 * max(1.0, abs(b[key])):
                return f"{key} {a[key]:.6g} against {b[key]:.6g}"
        return None

    check_against(rows, next((r for r in rows if r.name == REFERENCE and r.ok), None), close)
    notes = [
        f"{cfg['threads']} torch threads; the shard is 1/{cfg['world']} of each parameter of a model with "
        f"d_model {cfg['d_model']}, ffn {cfg['ffn']}, {cfg['layers']} blocks, vocab {cfg['vocab']}",
        "on a CPU device flatshard's step also copies between the device shards and the host copies (memory to "
        "memory); on a GPU those are PCIe copies, overlapped with backward (gradients) and the next forward "
        "(weights)",
    ]
    return rows, notes


def ratio_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    return [(r.name, REFERENCE) for r in rows if r.name != REFERENCE]
