"""Tensor parallelism inside a node, flat sharding across: DTensor parameters as local tensors.

[Note: tensor parallelism]
torch's ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``) turns a module's
parameters into DTensors on a 1-D "tensor_parallel" mesh and adds hooks that redistribute its inputs and outputs.
flatshard takes such a model as it is and shards it over the mesh's other, data-parallel, dimension:

- at ``shard()`` each DTensor parameter becomes a plain ``nn.Parameter`` of its local tensor (a new object: a
  DTensor cannot be swapped in place, so an optimizer is built after ``shard()``, as under FSDP2), and its
  layout (mesh, placements, global shape and stride) is kept by the handle that holds it
  (:class:`TensorParallelLayout`). Flat parameters, shards, gathers and gradient reductions are those of the
  local tensors, over the data-parallel groups only: a rank's tensor-parallel peers hold other pieces.
- the module sees, inside its unit's forward and backward, ``DTensor.from_local`` views of the gathered local
  tensors with the recorded layout, so the plan's hooks and DTensor's operators run as they would on the
  unsharded parallelized model. DTensor's backward gives each view its local gradient, already reduced over the
  tensor-parallel group where the layout asks for it (a replicated weight's partial gradient), and flatshard
  reduces it over the data-parallel ranks, which see different batches; the ranks of one tensor-parallel group
  see the same batch.
- between steps the parameters are 1-D pieces of the local shard, as without tensor parallelism, so
  elementwise optimizers step unchanged. An optimizer that needs each parameter whole (Muon, Shampoo) would see
  a tensor-parallel piece and is refused.
- full state dicts gather each tensor over the data-parallel group, then over the tensor-parallel group
  (``full_tensor``): plain tensors of the original shapes. In sharded state dicts a piece is a flat range of its
  tensor-parallel block (``ParamShard.block``), stored at its global offsets: the layout DCP reads on any mesh.
  ``load_pretrained`` reads such a piece as one byte range per row of the block.
- not supported, each refused with a hint: hybrid sharding, ``compile`` (torch's compiled backward of a
  tensor-parallel block fails on CPU without flatshard too), whole-tensor optimizers, ``unshard_params``, float8
  all-gathers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "TensorParallelLayout",
    "data_parallel_mesh",
    "is_dtensor",
    "plain_tensor_parallel_params",
]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor`` where nothing made one)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a build without distributed
        return False
    return isinstance(t, DTensor)


@dataclass(frozen=True, eq=False)
class TensorParallelLayout:
    """Where a tensor-parallel parameter's local tensor lies in the whole one: its 1-D mesh, placements, global
    shape and stride (see [Note: tensor parallelism])."""

    mesh: Any  # DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> TensorParallelLayout:
        return cls(t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()))

    @property
    def replicas(self) -> int:
        """Ranks of the mesh holding the same values (1 for a sharded parameter)."""
        return math.prod(self.mesh.size(d) for d, p in enumerate(self.placements) if p.is_replicate())

    @property
    def group(self) -> Any:
        return self.mesh.get_group(0)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the DTensor it is a piece of (differentiable: its gradient comes back local)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's ``local`` (collective over the mesh)."""
        with torch.no_grad():
            whole: torch.Tensor = self.wrap(local).full_tensor()  # type: ignore[attr-defined]
        return whole

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole tensor ``full`` (no communication)."""
        from torch.distributed.tensor import distribute_tensor

        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(
                f"a tensor-parallel parameter of shape {tuple(self.shape)} was given a tensor of shape "
                f"{tuple(full.shape)}."
            )
        with torch.no_grad():
            return distribute_tensor(full, self.mesh, self.placements, src_data_rank=None).to_local()

    def block(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of this rank's block of the whole tensor: ``Shard(d)`` cuts dimension ``d`` into
        ``ceil(n / k)``-sized chunks, as torch does; ``Replicate`` holds all of it."""
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for mesh_dim, placement in enumerate(self.placements):
            if placement.is_shard():
                d, k = placement.dim, self.mesh.size(mesh_dim)
                chunk = -(-sizes[d] // k)
                lo = min(self.mesh.get_local_rank(mesh_dim) * chunk, sizes[d])
                offsets[d], sizes[d] = offsets[d] + lo, min(chunk, sizes[d] - lo)
        return tuple(offsets), tuple(sizes)


def plain_tensor_parallel_params(
    module: nn.Module, ignored: Iterable[nn.Module] = ()
) -> dict[int, TensorParallelLayout]:
    """Replace every DTensor parameter under ``module`` by a plain ``nn.Parameter`` of its local tensor (on every
    module holding it); ``id(new parameter) -> layout``. See [Note: tensor parallelism]."""
    skip = {id(m) for m in ignored}
    made: dict[int, nn.Parameter] = {}
    layouts: dict[int, TensorParallelLayout] = {}
    meshes: dict[int, Any] = {}
    for m in module.modules():
        if id(m) in skip:
            continue
        for name, p in m._parameters.items():
            if p is None or not is_dtensor(p):
                continue
            if id(p) not in made:
                layout = TensorParallelLayout.of(p)
                if layout.mesh.ndim != 1:
                    raise ValueError(
                        f"{type(m).__name__}.{name} is a DTensor on a {layout.mesh.ndim}-D mesh; flatshard shards "
                        "tensor-parallel models whose DTensors live on one 1-D mesh. HINT: parallelize_module(model, "
                        "device_mesh['tensor_parallel'], plan)."
                    )
                if any(not (pl.is_shard() or pl.is_replicate()) for pl in layout.placements):
                    raise ValueError(
                        f"{type(m).__name__}.{name} has placements {layout.placements}; a parameter is Shard or "
                        "Replicate. HINT: redistribute it before shard()."
                    )
                meshes[id(layout.mesh)] = layout.mesh
                with torch.no_grad():
                    local = p.to_local().detach()  # type: ignore[attr-defined]
                if tuple(local.shape) != layout.block()[1]:
                    raise ValueError(
                        f"{type(m).__name__}.{name}: a local tensor of shape {tuple(local.shape)} is not the block "
                        f"{layout.block()[1]} that placements {layout.placements} give on this rank. HINT: use "
                        "torch's tensor-parallel styles (Colwise/Rowwise/SequenceParallel), which shard evenly."
                    )
                new = nn.Parameter(local, requires_grad=p.requires_grad)
                made[id(p)] = new
                layouts[id(new)] = layout
            m._parameters[name] = made[id(p)]
    if len(meshes) > 1:
        raise ValueError(
            "the model's DTensor parameters live on several meshes; flatshard supports one tensor-parallel mesh. "
            "HINT: parallelize every submodule over the same device_mesh['tensor_parallel']."
        )
    return layouts


def data_parallel_mesh(device_mesh: Any, tensor_parallel: Any | None) -> Any | None:
    """The data-parallel part of ``device_mesh``: the dimension before the tensor-parallel one (its last), as a
    1-D mesh; ``None`` when there is none. Without tensor-parallel parameters (``tensor_parallel`` is ``None``)
    the whole mesh."""
    if type(device_mesh).__name__ != "DeviceMesh":
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}.")
    if tensor_parallel is None:
        return device_mesh
    names = device_mesh.mesh_dim_names
    tp_names = tensor_parallel.mesh_dim_names
    if not names or not tp_names or names[-1] != tp_names[0]:
        raise ValueError(
            f"the model's DTensor parameters live on mesh dimension {tp_names} and device_mesh has dimensions "
            f"{names}; the tensor-parallel dimension must be device_mesh's last. HINT: init_device_mesh(device, "
            "(dp, tp), mesh_dim_names=('data_parallel', 'tensor_parallel')) and parallelize_module(model, "
            "mesh['tensor_parallel'], plan)."
        )
    if device_mesh.ndim > 2:
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions {names}; a tensor parallel model is sharded over a "
            "(data_parallel, tensor_parallel) mesh. HINT: init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('data_parallel', 'tensor_parallel'))."
        )
    return None if device_mesh.ndim == 1 else device_mesh[names[0]]
