"""Process-group helpers shared by the Trainer and Fabric strategies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor

from flatshard.engine import uses_nccl, wait_collective

__all__ = ["barrier", "broadcast_object", "init_process_group", "reduce_tensor", "set_world_ranks"]


class _ParallelStrategy(Protocol):
    """What these helpers read from the Trainer and Fabric strategies."""

    cluster_environment: ClusterEnvironment | None
    _process_group_backend: str | None
    _timeout: timedelta | None

    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...


def set_world_ranks(strategy: _ParallelStrategy) -> None:
    """Global rank and world size on the cluster environment, and the rank rank_zero_only compares to."""
    env = strategy.cluster_environment
    if env is None:
        return
    env.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
    env.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = env.global_rank()  # type: ignore[attr-defined]


def init_process_group(strategy: _ParallelStrategy) -> None:
    """Set the world ranks, initialize the default process group, pick the CUDA device.

    The backend is the strategy's ``process_group_backend`` or, by default, ``nccl`` on CUDA and ``gloo``
    on CPU; it is stored back on the strategy.
    """
    set_world_ranks(strategy)
    assert strategy.cluster_environment is not None
    backend = strategy._process_group_backend or _get_default_process_group_backend_for_device(
        strategy.root_device
    )
    strategy._process_group_backend = backend
    _init_dist_connection(strategy.cluster_environment, backend, timeout=strategy._timeout)
    if strategy.root_device.type == "cuda":
        torch.cuda.set_device(strategy.root_device)


def barrier(root_device: torch.device) -> None:
    """All ranks meet here; a rank out of step raises ``DesyncError`` (see [Note: finding a desync])."""
    if not _distributed_is_initialized():
        return
    if uses_nccl(None):
        work = torch.distributed.barrier(async_op=True, device_ids=[root_device.index])
    else:
        work = torch.distributed.barrier(async_op=True)
    wait_collective(work, "the strategy's barrier", op="barrier")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce_tensor(tensor: Tensor | Any, group: Any | None, reduce_op: Any | None) -> Any:
    """Reduce a tensor in place over ``group`` (default: all ranks), as Lightning's DDP and FSDP strategies do
    (a barrier, then the all-reduce; ``"mean"``/``"avg"`` divide a sum on backends without AVG); anything but a
    tensor passes through unchanged.

    Both collectives are waited on like flatshard's own, so a rank that reached its epoch-end reduction while
    another still trains raises ``DesyncError`` naming both (see [Note: finding a desync]).
    """
    if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
        return tensor
    dist = torch.distributed
    group = dist.group.WORLD if group is None else group
    divide = False
    op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if name == "avg" and not uses_nccl(group):
            op, divide = dist.ReduceOp.SUM, True  # gloo has no AVG
        else:
            op = getattr(dist.ReduceOp, name.upper())
    wait_collective(
        dist.barrier(group=group, async_op=True),
        "the barrier before a logged value's reduction",
        group,
        op="barrier",
    )
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    wait_collective(work, "the all_reduce of a logged value (sync_dist)", group, op="all_reduce")
    if not divide:
        return tensor
    world = dist.get_world_size(group)
    return tensor.div_(world) if torch.is_floating_point(tensor) else tensor.copy_(tensor / world)
