"""Flat-parameter layout: where each original parameter lives in a unit's flat tensor and in each shard.

No communication and no autograd here: only index math, so it is unit-tested without processes.

[Note: flat layout]
A unit's parameters ``p_0 .. p_{k-1}`` are flattened in planning order and concatenated into one 1-D
tensor of ``total_numel`` elements, then padded with zeros to ``padded_numel``, a multiple of the shard
group size ``W``. Rank ``r`` of the shard group owns elements ``[r * S, (r + 1) * S)`` with
``S = padded_numel / W``. An original parameter may lie entirely inside one rank's shard, span several,
or (for small parameters and large ``W``) be absent from a rank's shard: its local piece is then empty.
Padding is only ever at the end, so it belongs to the last rank(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

__all__ = ["FlatLayout", "ShardInfo", "flatten_tensors", "split_flat"]


class ShardInfo(NamedTuple):
    """Where one original parameter's local piece lives (for one rank)."""

    offset_in_shard: int  # first element of the piece inside the local shard
    numel_in_shard: int  # length of the piece (0 when this rank holds none of the parameter)
    offset_in_param: int  # index of the piece's first element in the flattened original parameter


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one unit's flat parameter for a shard group of ``world_size`` ranks."""

    shapes: tuple[torch.Size, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"FlatLayout needs world_size >= 1, got {self.world_size}.")

    # The layout is immutable and these are read per unit per pass: computed once (cached_property writes
    # the instance's __dict__ directly, which a frozen dataclass allows).
    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the (unpadded) flat tensor."""
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @cached_property
    def total_numel(self) -> int:
        return sum(self.numels)

    @cached_property
    def shard_numel(self) -> int:
        """Elements per rank (every rank's shard has this length, padding included)."""
        return -(-self.total_numel // self.world_size) if self.total_numel else 0

    @cached_property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @cached_property
    def padding(self) -> int:
        return self.padded_numel - self.total_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded flat tensor."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the shard group of size {self.world_size}.")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_infos(self, rank: int) -> tuple[ShardInfo, ...]:
        """For each parameter, the piece of it that ``rank``'s shard holds."""
        lo, hi = self.shard_range(rank)
        infos = []
        for offset, numel in zip(self.offsets, self.numels, strict=False):
            start, end = max(offset, lo), min(offset + numel, hi)
            if end <= start:
                infos.append(ShardInfo(0, 0, 0))
            else:
                infos.append(ShardInfo(start - lo, end - start, start - offset))
        return tuple(infos)

    def valid_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard that are not padding."""
        lo, hi = self.shard_range(rank)
        return max(0, min(hi, self.total_numel) - lo)


def flatten_tensors(
    tensors: list[torch.Tensor], layout: FlatLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Concatenate ``tensors`` into one padded 1-D tensor laid out as ``layout`` says (into ``out`` if given)."""
    if not tensors:
        raise ValueError("flatten_tensors needs at least one tensor.")
    dtype, device = tensors[0].dtype, tensors[0].device
    flat = torch.empty(layout.padded_numel, dtype=dtype, device=device) if out is None else out
    torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[: layout.total_numel])
    if layout.padding:
        flat[layout.total_numel :].zero_()
    return flat


def split_flat(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of each original parameter (original shape) inside a padded flat tensor."""
    pieces = torch.split(flat[: layout.total_numel], list(layout.numels))
    return [p.view(s) for p, s in zip(pieces, layout.shapes, strict=False)]
