"""Shared pieces of the GPU tier: where ranks run, and comparisons with an unsharded reference.

Two ranks go one per GPU over NCCL when there are two GPUs or more; on a machine with one GPU both run on
GPU 0 over gloo (NCCL refuses two ranks on one device; gloo moves CUDA tensors through pinned host buffers), so
the engine's streams, events, pinned offload copies and the limiter still run on a real GPU. Functions that run
inside ``flatshard.testing.spawn`` live in the test modules (module level, picklable).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn

import flatshard

__all__ = [
    "init_eagerly",
    "max_abs_diff",
    "name_seeded_init",
    "rank_device",
    "ranks_and_backend",
    "reference_params",
    "sharded_params",
]


def ranks_and_backend(world: int = 2) -> tuple[int, str]:
    """``(world, backend)``: NCCL with a GPU per rank if there are enough GPUs, else gloo on shared GPUs."""
    return (world, "nccl") if torch.cuda.device_count() >= world else (world, "gloo")


def rank_device(rank: int) -> torch.device:
    """This rank's GPU (rank modulo the GPU count), made the current device."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def sharded_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters of a sharded model, by name, as CPU fp32 copies (a collective: every rank)."""
    with flatshard.unshard_params(model, offload_to_cpu=True):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def reference_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in b)


def name_seeded_init(names: dict[nn.Module, str]):  # type: ignore[no-untyped-def]
    """An init function giving each parameter values fixed by its full name only (any order, any device)."""

    def init(module: nn.Module) -> None:
        prefix = names[module]
        for name, p in module.named_parameters(recurse=False):
            g = torch.Generator().manual_seed(zlib.crc32(f"{prefix}.{name}".encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    return init


def init_eagerly(model: nn.Module) -> nn.Module:
    """``model`` initialized with :func:`name_seeded_init` (the first holder of a tied weight wins)."""
    names = {m: n for n, m in model.named_modules()}
    init = name_seeded_init(names)
    seen: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            if own:
                saved = {id(p): p.detach().clone() for p in m.parameters(recurse=False) if id(p) in seen}
                init(m)
                for p in m.parameters(recurse=False):  # a weight tied to an earlier holder keeps its values
                    if id(p) in saved:
                        p.copy_(saved[id(p)])
                seen.update(id(p) for p in own)
    return model
