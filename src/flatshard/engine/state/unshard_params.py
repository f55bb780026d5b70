"""``unshard_params``: the full parameters (and optionally gradients) on the modules, between steps.

[Note: unshard_params]
Inside the context every original Parameter's data is its full tensor, a view of the unit's gathered
flat parameter (a fresh buffer, so nothing a collective or the optimizer owns is exposed). On exit, with
``writeback`` each rank copies its own slice back into its shard; with ``rank0_only`` only rank 0 of
each unit's shard group held the full parameters, so on exit its flat parameter is broadcast one unit at
a time, each rank keeps its slice and the buffer is freed: the other ranks never hold more than one
unit unsharded. Replicas (NO_SHARD) then take the shard of replica 0. A forward inside runs on the full
parameters with no collective (see [Note: forward inside unshard_params]); backward and loading state raise
inside the context. Reading state (``get_state_dict``, and so a checkpoint saved inside) reads the shards,
which the context leaves untouched until it exits: the state as it was on entering, not the full views and
what was changed in them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.flat_param import split_flat
from flatshard.engine.handle import FlatParamHandle
from flatshard.engine.runtime import Summoned, UnitState, get_unit_state
from flatshard.engine.state.full_model import gather_full_flat, prepare_for_state_io
from flatshard.engine.transport import comm

__all__ = ["unshard_params"]


@dataclass
class _Unsharded:
    handle: FlatParamHandle
    full: torch.Tensor | None  # None on ranks that do not hold the full parameters (rank0_only)
    full_grad: torch.Tensor | None
    grad_shard: torch.Tensor | None  # held here: while .grad shows full views nothing else keeps it alive
    had_grad: list[bool]


def _is_group_rank0(handle: FlatParamHandle) -> bool:
    return handle.shard_rank == 0 and (
        handle.replicate_group is None
        or not (dist.is_available() and dist.is_initialized())
        or dist.get_rank(handle.replicate_group) == 0
    )


def _grad_shard(handle: FlatParamHandle) -> torch.Tensor | None:
    """The gradient shard behind the parameters' ``.grad`` views, if any parameter has a gradient."""
    return handle._sharded_grad_ref() if any(p.grad is not None for p in handle.params) else None


def _padded(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    """A gradient shard at full shard length: frozen parameters' part is not stored (see [Note: frozen
    parameters]), so it is zero-filled here."""
    n = handle.sharded.numel()
    if shard.numel() == n:
        return shard
    out = torch.zeros(n, dtype=shard.dtype, device=shard.device)
    out[: shard.numel()].copy_(shard)
    return out


def _gather(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    shard = _padded(handle, shard)
    if handle.shard_world == 1:
        return shard.clone()  # never expose the live shard: writeback=False must discard changes
    full = torch.empty(handle.layout.padded_numel, dtype=shard.dtype, device=handle.device)
    comm.all_gather_flat(full, shard.to(handle.device), handle.shard_group, async_op=False)
    return full


def _enter(handle: FlatParamHandle, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> _Unsharded:
    keep = not rank0_only or _is_group_rank0(handle)
    had_grad = [p.grad is not None for p in handle.params]
    full = gather_full_flat(handle) if handle.shard_world > 1 else handle.sharded.clone()
    grad_shard = _grad_shard(handle) if with_grads else None
    full_grad = _gather(handle, grad_shard) if grad_shard is not None else None
    if not keep:
        return _Unsharded(handle, None, None, grad_shard, had_grad)
    if offload_to_cpu:
        full = full.cpu()
        full_grad = full_grad.cpu() if full_grad is not None else None
    for p, view in zip(handle.params, split_flat(full, handle.layout), strict=True):
        p.data = view
    if full_grad is not None:
        for p, view, had in zip(handle.params, split_flat(full_grad, handle.layout), had_grad, strict=True):
            p.grad = view if had else None
    return _Unsharded(handle, full, full_grad, grad_shard, had_grad)


def _broadcast_from_rank0(
    handle: FlatParamHandle, full: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """Rank 0's flat tensor on every rank of the shard group (a temporary buffer elsewhere).

    The broadcast runs on the compute device: with CPU offload the shards are CPU tensors, which NCCL
    refuses. The result is on the compute device; callers copy their slice into the shard.
    """
    if full is None:
        full = torch.empty(handle.layout.padded_numel, dtype=like.dtype, device=handle.device)
    else:
        full = full.to(handle.device)
    if handle.shard_world > 1 and handle.shard_group is not None:
        src = dist.get_global_rank(handle.shard_group, 0)
        dist.broadcast(comm.as_wire(full), src=src, group=handle.shard_group)
    return full


def _sync_replicas(handle: FlatParamHandle, shard: torch.Tensor) -> None:
    """Replica groups take shard-group rank 0's replica's values (rank0_only writeback changed only theirs).

    Broadcast on the compute device, as above: an offloaded shard goes over and comes back as a copy."""
    if handle.replicate_world > 1 and handle.replicate_group is not None:
        src = dist.get_global_rank(handle.replicate_group, 0)
        if shard.device == handle.device:
            dist.broadcast(comm.as_wire(shard), src=src, group=handle.replicate_group)
            return
        staged = shard.to(handle.device)
        dist.broadcast(comm.as_wire(staged), src=src, group=handle.replicate_group)
        shard.copy_(staged)


def _write_slice(handle: FlatParamHandle, full: torch.Tensor, shard: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into ``shard`` (a gradient shard may hold only its prefix)."""
    lo = handle.layout.shard_range(handle.shard_rank)[0] if handle.shard_world > 1 else 0
    with torch.no_grad():
        shard.copy_(full[lo : lo + shard.numel()])


def _exit(u: _Unsharded, writeback: bool, rank0_only: bool) -> None:
    handle = u.handle
    handle.use_sharded_views()
    grad_shard = u.grad_shard
    if writeback:
        if rank0_only:
            full = _broadcast_from_rank0(handle, u.full, handle.sharded)
            _write_slice(handle, full, handle.sharded)
            del full
            _sync_replicas(handle, handle.sharded)
        else:
            assert u.full is not None
            _write_slice(handle, u.full.to(handle.sharded.device), handle.sharded)
    # gradients: restore the shard views; write modified full gradients back with writeback
    if grad_shard is not None and writeback:
        if rank0_only:
            full_grad = _broadcast_from_rank0(handle, u.full_grad, grad_shard)
            _write_slice(handle, full_grad, grad_shard)
            _sync_replicas(handle, grad_shard)
        elif u.full_grad is not None:
            _write_slice(handle, u.full_grad.to(grad_shard.device), grad_shard)
    if grad_shard is not None:
        for i, (p, had) in enumerate(zip(handle.params, u.had_grad, strict=True)):
            p.grad = handle._shard_piece(grad_shard, i) if had else None


@contextmanager
def unshard_params(
    module: nn.Module,
    *,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose full parameters on a sharded module's Parameters; call on every rank, between steps.

    See [Note: unshard_params]. A forward inside runs on the full parameters without collectives, on every
    rank or, with ``rank0_only``, on rank 0 alone (generation, evaluation, export); backward is refused.

    Args:
        module: a module sharded with ``flatshard.shard`` (or a unit inside one).
        writeback: keep changes made to the full parameters (and, with ``with_grads``, gradients). With
            ``rank0_only``, rank 0's values are kept and broadcast. Default: ``True``.
        rank0_only: only rank 0 of each unit's group materializes full parameters; the others keep their
            pieces and hold at most one unit unsharded at a time on exit. Default: ``False``.
        offload_to_cpu: put the full parameters in CPU memory. Default: ``False``.
        recurse: unshard every unit under ``module``; ``False``: only ``module``'s own unit. Default: ``True``.
        with_grads: also expose full gradients on ``.grad`` (parameters without a gradient keep ``None``).
            Default: ``False``.
    """
    states: list[UnitState] = prepare_for_state_io(module, "unshard_params")
    if not recurse:
        own = get_unit_state(module)
        if own is None:
            raise ValueError(
                f"unshard_params(recurse=False) needs a unit, and {type(module).__name__} is not one. HINT: pass "
                "the module given to flatshard.shard (or a wrapped submodule), or use recurse=True."
            )
        states = [own]
    if any(h.tensor_parallel is not None for s in states for h in s.handles):
        raise ValueError(
            "unshard_params of a tensor parallel model would give each rank its tensor-parallel pieces as plain "
            "tensors, which the model's plan cannot run (see [Note: tensor parallelism]). HINT: call the model (or "
            "a method registered with register_forward_method, such as generate) directly: it gathers as in "
            "training; for whole weights use get_state_dict(model) or save_checkpoint / save_pretrained."
        )
    done: list[_Unsharded] = []
    for s in states:
        s.summoned = Summoned.FULL
    try:
        for s in states:
            for handle in s.handles:
                done.append(_enter(handle, rank0_only, offload_to_cpu, with_grads))
                if done[-1].full is None:
                    s.summoned = Summoned.SHARDS_ONLY
        yield
    finally:
        try:
            for u in done:
                _exit(u, writeback, rank0_only)
        finally:
            for s in states:
                s.summoned = Summoned.NO
