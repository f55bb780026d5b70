"""``FlatPieces``: a flat 1-D tensor given as pieces at offsets, read by a transport without packing it.

Transport-level: a collective (see ``comm.reduce_scatter_flat`` and ``shm.ShmGroup.reduce_scatter``) copies
or adds the pieces straight into its buffers, so a unit's gradient is never packed into a second flat copy.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence

import torch

__all__ = ["FlatPieces"]


class FlatPieces:
    """A 1-D tensor of ``numel`` elements given as pieces at increasing offsets, zeros between and after.

    A unit's gradient as autograd produced it: each trainable parameter's gradient at its offset in the
    flat layout, frozen or unused parameters and the padding as zeros. A transport that copies the flat
    gradient out step by step reads it from here (:meth:`copy_into` / :meth:`add_into`) and the packed
    flat buffer is never allocated. Pieces may have another floating dtype than :attr:`dtype`: the copy
    converts, as packing would.
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, pieces: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        self._numel = numel
        self.dtype = dtype
        self.device = device
        self._starts: list[int] = []
        self._pieces: list[torch.Tensor] = []
        end = 0
        for offset, tensor in pieces:
            flat = tensor.reshape(-1)
            if offset < end or offset + flat.numel() > numel:
                raise ValueError(
                    f"FlatPieces: a piece of {flat.numel()} elements at offset {offset} overlaps the previous "
                    f"piece (ending at {end}) or runs past {numel} elements."
                )
            if flat.numel():
                self._starts.append(offset)
                self._pieces.append(flat)
                end = offset + flat.numel()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> FlatPieces:
        """One piece: a contiguous 1-D tensor read through the same interface."""
        return cls(tensor.numel(), tensor.dtype, tensor.device, [(0, tensor)])

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def _spans(self, start: int, end: int) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """``(lo, hi, source)`` covering ``[start, end)`` in order; ``source`` is ``None`` for zeros."""
        starts, pieces = self._starts, self._pieces
        i = max(0, bisect_right(starts, start) - 1)
        pos = start
        while pos < end:
            while i < len(starts) and starts[i] + pieces[i].numel() <= pos:
                i += 1
            if i == len(starts) or starts[i] >= end:
                yield pos, end, None
                return
            if starts[i] > pos:
                yield pos, starts[i], None
                pos = starts[i]
            hi = min(end, starts[i] + pieces[i].numel())
            yield pos, hi, pieces[i][pos - starts[i] : hi - starts[i]]
            pos = hi

    def copy_into(self, dst: torch.Tensor, start: int) -> None:
        """``dst[:] = self[start : start + len(dst)]``."""
        for lo, hi, src in self._spans(start, start + dst.numel()):
            part = dst[lo - start : hi - start]
            if src is None:
                part.zero_()
            else:
                part.copy_(src)

    def add_into(self, dst: torch.Tensor, start: int) -> None:
        """``dst += self[start : start + len(dst)]``."""
        for lo, hi, src in self._spans(start, start + dst.numel()):
            if src is not None:
                dst[lo - start : hi - start].add_(src)

    def release(self) -> None:
        """Drop the pieces after the last read: their memory is freed once nothing else holds them."""
        self._starts, self._pieces = [], []

    def materialize(self, out: torch.Tensor) -> torch.Tensor:
        """The whole tensor, written into ``out`` (1-D, ``numel`` elements)."""
        self.copy_into(out, 0)
        return out
