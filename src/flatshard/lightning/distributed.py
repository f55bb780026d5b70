"""Process-group helpers shared by the Trainer and Fabric strategies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor

__all__ = ["barrier", "broadcast_object", "init_process_group", "reduce_tensor"]


def init_process_group(
    env: ClusterEnvironment,
    node_rank: int,
    local_rank: int,
    num_processes: int,
    num_nodes: int,
    backend: str | None,
    timeout: timedelta | None,
    root_device: torch.device,
) -> str:
    """Set the world ranks on ``env``, initialize the default process group, pick the CUDA device.

    Returns the backend used (``nccl`` on CUDA, ``gloo`` on CPU unless ``backend`` says otherwise).
    """
    env.set_global_rank(node_rank * num_processes + local_rank)
    env.set_world_size(num_nodes * num_processes)
    rank_zero_only.rank = env.global_rank()  # type: ignore[attr-defined]
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    _init_dist_connection(env, backend, timeout=timeout)
    if root_device.type == "cuda":
        torch.cuda.set_device(root_device)
    return backend


def barrier(root_device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[root_device.index])
    else:
        torch.distributed.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce_tensor(tensor: Tensor | Any, group: Any | None, reduce_op: Any | None) -> Any:
    """Reduce a tensor over ``group`` (default: all ranks); anything else passes through unchanged."""
    if isinstance(tensor, Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
