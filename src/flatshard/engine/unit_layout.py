"""The layout of a sharded module as plain records: what each unit holds, gathers and reduces, per rank.

Planning tools (``flatshard.estimate``) read a module sharded by :func:`~flatshard.engine.shard` (on the meta
device: see [Note: sharding on the meta device] in ``flatshard.engine.shard``) through these records instead of
the handles' attributes; every number comes from the handle's own :class:`~flatshard.engine.flat_param.FlatLayout`,
so the records and the engine cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

from flatshard.engine.activation_offload import OffloadStats
from flatshard.engine.runtime import unit_states
from flatshard.engine.step.whole_plan import cost as _cost

__all__ = [
    "UnitLayout",
    "activation_offload_stats",
    "gathered_buffers",
    "unit_layouts",
    "whole_tensor_owners",
]


class UnitLayout(NamedTuple):
    """One flat parameter of one unit (a unit of several dtypes has one per dtype)."""

    path: str  # the unit module's path under the sharded root ("<root>" for the root)
    is_root: bool
    reshard_after_forward: bool  # freed after forward and gathered again for backward
    node_copy: int  # reshard_after_forward=k: backward gathers over k ranks (0: over the shard group)
    numel: int  # elements of the unit's parameters (without padding)
    padded_numel: int  # the gathered flat parameter's length
    shard_numel: int  # elements every rank of the shard group holds (padding included)
    shard_world: int
    replicate_world: int
    param_dtype: torch.dtype  # the shard (master weights)
    compute_dtype: torch.dtype  # the gathered flat parameter
    reduce_dtype: torch.dtype  # gradient communication
    grad_dtype: torch.dtype  # the gradient shard the optimizer sees
    trainable_extent: int  # end of the last trainable parameter in the flat parameter (0: none trains)
    all_trainable: bool
    offload: bool  # shard and gradient shard in host memory
    gathers: bool  # whether the gathered flat parameter is a buffer of its own (not the shard itself)
    shapes: tuple[torch.Size, ...]  # the original parameters' shapes, in flat order
    trainable: tuple[bool, ...]  # per original parameter

    @property
    def reduce_chunk(self) -> int:
        """Elements of each rank's shard a gradient reduction moves (see [Note: reducing only what trains])."""
        shard = self.padded_numel if self.shard_world == 1 else self.shard_numel
        return shard if self.all_trainable else min(shard, self.trainable_extent)

    def grad_numel(self, rank: int) -> int:
        """Elements of ``rank``'s (rank in the shard group) gradient shard (see [Note: frozen parameters])."""
        if self.shard_world == 1:
            lo, hi = 0, self.padded_numel
        else:
            lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        if not any(self.trainable):
            return 0
        return hi - lo if self.all_trainable else max(0, min(self.trainable_extent, hi) - lo)

    def piece_numels(self, index: int) -> list[int]:
        """Elements of original parameter ``index`` in each rank's shard."""
        offset = sum(int(s.numel()) for s in self.shapes[:index])
        numel = int(self.shapes[index].numel())
        if self.shard_world == 1:
            return [numel]
        out = []
        for r in range(self.shard_world):
            lo, hi = r * self.shard_numel, (r + 1) * self.shard_numel
            out.append(max(0, min(offset + numel, hi) - max(offset, lo)))
        return out


def unit_layouts(module: nn.Module) -> list[UnitLayout]:
    """One record per flat parameter of every unit at or below ``module`` (sharded), in ``.modules()`` order."""
    out = []
    for state in unit_states(module):
        for h in state.handles:
            out.append(
                UnitLayout(
                    path=state.path,
                    is_root=state.module is module,
                    reshard_after_forward=state.reshard_after_forward is not False,
                    node_copy=0
                    if isinstance(state.reshard_after_forward, bool)
                    else state.reshard_after_forward,
                    numel=h.layout.total_numel,
                    padded_numel=h.layout.padded_numel,
                    shard_numel=h.layout.shard_numel,
                    shard_world=h.shard_world,
                    replicate_world=h.replicate_world,
                    param_dtype=h.dtype,
                    compute_dtype=h.precision.compute,
                    reduce_dtype=h.precision.reduce,
                    grad_dtype=h.precision.grad,
                    trainable_extent=h._trainable_end,
                    all_trainable=h.all_require_grad,
                    offload=h.offload,
                    gathers=not h._gather_is_shard,
                    shapes=tuple(h.layout.shapes),
                    trainable=tuple(h.requires_grad),
                )
            )
    return out


def gathered_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The gathered flat parameters (storage empty while sharded) of every unit at or below ``module`` that
    gathers into a buffer of its own: what a memory tracker reads to see gathered units come and go."""
    return [h.flat for s in unit_states(module) for h in s.handles if not h._gather_is_shard]


def whole_tensor_owners(shapes: Sequence[torch.Size], world: int) -> list[int]:
    """The owner rank of each parameter of a whole-tensor optimizer sharded over ``world`` ranks, as
    [Note: whole-tensor optimizers] assigns them: by decreasing cost, each to the least loaded rank."""
    owners = [-1] * len(shapes)
    load = [0] * world
    for i in sorted(range(len(shapes)), key=lambda i: -_cost(torch.Size(shapes[i]))):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += _cost(torch.Size(shapes[i]))
    return owners


def activation_offload_stats(module: nn.Module) -> OffloadStats | None:
    """What the activation offload of the root over ``module`` did (see [Note: activation offload]); ``None``
    before its first forward. Its counters run whether ``activation_offload`` is on or not (off: all zero)."""
    states = unit_states(module)
    ctx = states[0].ctx if states else None
    return None if ctx is None else ctx.activations.stats
