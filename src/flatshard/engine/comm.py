"""Collectives as plain functions over flat 1-D tensors, with backend quirks handled in one place.

Each function issues the collective and returns a :class:`Pending` (the output and the work handle, or
``None`` when the collective finished synchronously). Callers wait on it when they need the output;
that is what lets communication overlap compute, on CUDA streams and on CPU/gloo alike.

Quirks handled here:
- gloo has no AVG reduction: reductions are SUM and the caller divides (``divide_factor``).
- older torch builds lack gloo ``reduce_scatter_tensor``: fall back to all-reduce + local slice.
- newer torch builds rename ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``.
- CPU tensors of ranks on one host go through shared memory instead of the backend (see
  [Note: shared-memory collectives] in :mod:`flatshard.engine.shm`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from flatshard.engine import shm

__all__ = [
    "Pending",
    "all_gather_flat",
    "all_reduce_flat",
    "comm_stats",
    "reduce_scatter_flat",
]

ProcessGroup = Any  # torch.distributed.ProcessGroup; typed loosely for older torch stubs

_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Backends that raised "not supported" for reduce_scatter once: never tried again in this process.
_NO_NATIVE_REDUCE_SCATTER: set[str] = set()

comm_stats: Counter[str] = Counter()
"""Bytes this process sent into each collective kind (``"all_gather"``, ``"reduce_scatter"``,
``"all_reduce"``); reset with ``comm_stats.clear()``."""


class Pending(NamedTuple):
    """A collective in flight: ``output`` is valid after ``wait()``."""

    output: torch.Tensor
    work: Any | None  # torch.distributed.Work, or None when already complete

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.output


def _group_size(group: ProcessGroup | None) -> int:
    return int(dist.get_world_size(group))


def _shm_for(group: ProcessGroup | None, *tensors: torch.Tensor) -> shm.ShmGroup | None:
    """The group's shared-memory transport if these tensors can use it (CPU, contiguous, known dtype)."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in shm.DTYPES:
            return None
    return shm.shm_group(group)


def _issued(output: torch.Tensor, work: Any, async_op: bool) -> Pending:
    if not async_op:
        work.wait()
        return Pending(output, None)
    return Pending(output, work)


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, async_op: bool = True
) -> Pending:
    """Gather every rank's ``shard`` into ``output`` (``len(output) == world * len(shard)``)."""
    if output.numel() != shard.numel() * _group_size(group):
        raise ValueError(
            f"all_gather_flat: output has {output.numel()} elements, expected "
            f"{shard.numel()} x {_group_size(group)}."
        )
    comm_stats["all_gather"] += shard.numel() * shard.element_size()
    channel = _shm_for(group, output, shard)
    if channel is not None:
        return _issued(output, channel.all_gather(output, shard), async_op)
    work = _all_gather_base(output, shard, group=group, async_op=async_op)
    return Pending(output, work if async_op else None)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, async_op: bool = True
) -> Pending:
    """Sum ``full`` over ranks and keep this rank's slice in ``output``.

    ``full`` may be overwritten (used as scratch by the fallback path).
    """
    world = _group_size(group)
    if full.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_flat: input has {full.numel()} elements, expected {output.numel()} x {world}."
        )
    comm_stats["reduce_scatter"] += full.numel() * full.element_size()
    channel = _shm_for(group, output, full)
    if channel is not None:
        return _issued(output, channel.reduce_scatter(output, full), async_op)
    backend = str(dist.get_backend(group))
    if backend not in _NO_NATIVE_REDUCE_SCATTER:
        try:
            work = _reduce_scatter_base(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            return Pending(output, work if async_op else None)
        except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - depends on torch build
            if "support" not in str(err).lower():
                raise
            _NO_NATIVE_REDUCE_SCATTER.add(backend)
    # Fallback: all-reduce in place, then copy our slice (twice the traffic, same result).
    dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
    rank = dist.get_rank(group)
    output.copy_(full[rank * output.numel() : (rank + 1) * output.numel()])
    return Pending(output, None)


def all_reduce_flat(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = True) -> Pending:
    """Sum ``tensor`` over ``group`` in place."""
    comm_stats["all_reduce"] += tensor.numel() * tensor.element_size()
    channel = _shm_for(group, tensor)
    if channel is not None:
        return _issued(tensor, channel.all_reduce(tensor), async_op)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(tensor, work if async_op else None)
