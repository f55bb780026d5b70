"""Gradient-norm clipping across shards: the norm of the whole (unsharded) gradient, on every rank."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.handle import FlatParamHandle, handle_of_param

__all__ = ["clip_grad_norm_", "clip_grad_norm_params_"]


def _accumulate(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if norm_type == float("inf"):
        return torch.stack(
            [
                g.detach().abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                for g in grads
            ]
        ).max()
    return sum(
        (torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads),
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
    of parameters flatshard does not manage count once, locally.
    """
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    sharded: dict[int, tuple[FlatParamHandle, list[torch.Tensor]]] = {}
    local: list[torch.Tensor] = []
    for p in params:
        handle = handle_of_param(p)
        assert p.grad is not None
        if handle is not None and handle.shard_world > 1:
            sharded.setdefault(id(handle.shard_group), (handle, []))[1].append(p.grad)
        else:
            local.append(p.grad)
    total = _accumulate(local, norm_type)
    for handle, grads in sharded.values():
        part = _accumulate(grads, norm_type).to(handle.device)
        if norm_type == float("inf"):
            part = _max_over(part, handle.shard_group)
            total = torch.maximum(total, part.cpu())
        else:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=handle.shard_group)
            total = total + part.cpu()
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
