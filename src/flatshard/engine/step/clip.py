"""Gradient-norm clipping across shards: the norm of the whole (unsharded) gradient, on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.handle import FlatParamHandle, locate_params

__all__ = ["clip_grad_norm_", "clip_grad_norm_params_"]


def _accumulate(
    grads: list[torch.Tensor], norm_type: float, weights: list[float] | None = None
) -> torch.Tensor:
    """The p-th power of the p-norm of ``grads`` (each counted ``weight`` times), or their max for ``inf``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if norm_type == float("inf"):
        return torch.stack(
            [
                g.detach().abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                for g in grads
            ]
        ).max()
    weights = weights or [1.0] * len(grads)
    return sum(
        (
            torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type * w
            for g, w in zip(grads, weights, strict=True)
        ),
        torch.zeros((), dtype=torch.float32, device=grads[0].device),
    )


def _max_over(value: torch.Tensor, group: object) -> torch.Tensor:
    """The maximum of the scalar ``value`` over ``group``, NaN if any rank's is NaN.

    A MAX reduction may drop a NaN (gloo's keeps whichever operand compares first), so whether some rank
    holds one travels as a flag of its own.
    """
    nan = torch.isnan(value)
    packed = torch.stack([torch.where(nan, torch.zeros_like(value), value), nan.to(value.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], float("nan")), packed[0])


def clip_grad_norm_params_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients of ``parameters`` (sharded or not) by their global norm; returns the total norm.

    Sharded gradients contribute their local piece and are summed over their shard group; gradients
    of parameters flatshard does not manage count once, locally. In a tensor-parallel model (see [Note: tensor
    parallelism]) the sums go on over the tensor-parallel group, where a gradient that every rank of it holds
    (a replicated parameter) counts once.
    """
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    sharded: dict[tuple[int, int], tuple[FlatParamHandle, Any, list[torch.Tensor], list[float]]] = {}
    local: list[torch.Tensor] = []
    for p, (handle, index) in zip(params, locate_params(params), strict=True):
        assert p.grad is not None
        layouts = handle.tensor_parallel if handle is not None else None
        if handle is not None and (handle.shard_world > 1 or layouts is not None):
            tp = next((t for t in layouts if t is not None), None) if layouts is not None else None
            key = (id(handle.shard_group), id(tp.group) if tp is not None else 0)
            entry = sharded.setdefault(key, (handle, tp, [], []))
            entry[2].append(p.grad)
            if tp is not None:  # a parameter all tensor-parallel ranks hold counts once
                own = layouts[index]  # type: ignore[index]
                entry[3].append(1.0 / (own.replicas if own is not None else tp.mesh.size()))
            else:
                entry[3].append(1.0)
        else:
            local.append(p.grad)
    total = _accumulate(local, norm_type)
    for handle, tp, grads, weights in sharded.values():
        part = _accumulate(grads, norm_type, weights).to(handle.device)
        groups = [g for g in (handle.shard_group if handle.shard_world > 1 else None, tp and tp.group) if g]
        for group in groups:
            if norm_type == float("inf"):
                part = _max_over(part, group)
            else:
                dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, part.cpu()) if norm_type == float("inf") else total + part.cpu()
    total_norm = total if norm_type == float("inf") else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total_norm.item()}); "
            "gradients were left unchanged. HINT: lower the learning rate or check the loss for inf/nan."
        )
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total_norm


def clip_grad_norm_(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of all of ``module``'s parameters by the global norm; call on every rank.

    Args:
        module: a module sharded with ``flatshard.shard``.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm (``float('inf')`` for the max norm). Default: ``2.0``.
        error_if_nonfinite: raise (before changing any gradient) if the norm is inf or nan. Default: ``False``.

    Returns:
        The total norm before clipping (a CPU scalar tensor), the same on every rank.
    """
    return clip_grad_norm_params_(module.parameters(), max_norm, norm_type, error_if_nonfinite)
