"""Moving shards of flat tensors (parameters, optimizer state) to the ranks that keep a full state.

[Note: streamed full-state gathers]
A full state dict needs, on the ranks that keep it (rank 0 alone by default), every unit's whole flat
parameter and every elementwise optimizer state laid out like it, as full-shape tensors. Callers
describe what they need as :class:`GatherItem` s (one per unit and per optimizer-state key), and
:func:`gather_items` moves all of them in one pass:

* **Outputs first, faulted in ahead.** Every output tensor is allocated before the first byte moves,
  each in a fresh mapping of its own, and handed to a :class:`~flatshard.engine.transport.memory.Prefaulter`
  whose threads back the pages while the copies run (see [Note: prefaulting outputs]). The outputs
  are the result, so this adds nothing to the peak.
* **Bounded memory.** A shard travels in chunks of at most ``chunk_bytes``; a rank that keeps nothing
  holds no more than two chunks extra, and no rank ever holds a unit unsharded in a flat buffer.
  Chunks are copied straight into the outputs, piece by piece: no gathered flat copy, no second copy
  to CPU.
* **The cheapest transport that is correct.** Ranks of one host exchanging CPU tensors use shared
  memory: each sending rank owns a two-slot shared-memory segment; for chunk ``k`` it fills slot
  ``k % 2``, all ranks pass one barrier, and the keepers copy straight out of the slot while the senders
  fill the other slot. A sender reuses a slot only after the next barrier, which no keeper enters
  before it finished reading that slot. A rank that only keeps (rank 0 of a ``rank0_only`` gather)
  writes no slot, so its segment is never reserved (``reserve_if`` of
  :func:`~flatshard.engine.transport.shm.exchange_segments`) and costs no memory. Each byte is copied
  once on each side, where a gloo collective over loopback TCP moves it several times. Anything else
  (several hosts, CUDA tensors, no anonymous shared memory, ``FLATSHARD_SHM=0``) uses collectives per chunk:
  ``gather`` to the one keeping rank on gloo, ``all_gather`` otherwise.

A chunk of a dtype that a backend cannot move (float8, uint16-64, complex32, ...) travels as its bytes, and a
complex one as pairs of floats (gloo's ``gather`` refuses complex tensors): see [Note: dtypes on the wire] in
:mod:`flatshard.engine.transport.comm`. The shared-memory slots hold bytes, read as any dtype.

The transport is agreed on by all ranks of the group in one object collective when the stream opens,
so a rank that cannot map a peer's segment makes every rank fall back, never hang. Segments have no name in
``/dev/shm``: a rank killed at any moment leaves nothing there (see [Note: segments without names]).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flatshard.engine.flat_param import FlatLayout
from flatshard.engine.transport.comm import as_wire
from flatshard.engine.transport.memory import Prefaulter, empty_mapped
from flatshard.engine.transport.shm import Segment, exchange_segments

__all__ = [
    "FlatStream",
    "GatherItem",
    "Piece",
    "UnitOutputs",
    "gather_by_unit",
    "gather_items",
]

Piece = tuple[int, torch.Tensor]
"""``(offset in the local shard, 1-D tensor)``: part of this rank's shard of one flat tensor."""

ProcessGroup = Any

DEFAULT_CHUNK_BYTES = 16 << 20


class FlatStream:
    """Streams shards of flat tensors within one shard group; opened collectively, see [Note: streamed
    full-state gathers]. Every rank of ``group`` must make the same sequence of :meth:`gather` calls."""

    def __init__(
        self,
        group: ProcessGroup | None,
        keep: bool,
        device: torch.device,
        chunk_bytes: int | None = None,
        local: bool = False,
    ) -> None:
        self.group = group
        self.device = device
        chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.chunk_bytes = max(4096, chunk_bytes - chunk_bytes % 4096)
        # ``local``: a shard group of one rank (the shard is the whole flat tensor), nothing to exchange
        distributed = dist.is_available() and dist.is_initialized() and not local
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.keep = keep
        self.keepers: list[int] = [self.rank] if keep else []
        self.transport = "local"
        self._segments: dict[int, Segment] = {}
        self._own: Segment | None = None
        self._step = 0
        self._send: torch.Tensor | None = None
        self._recv: torch.Tensor | None = None
        if self.world > 1:
            self._open()

    # -- setup -------------------------------------------------------------------------------------

    def _open(self) -> None:
        everyone, own, peers = exchange_segments(
            self.group,
            2 * self.chunk_bytes,
            "gather",
            possible=self.device.type == "cpu",
            open_peers=self.keep,  # only keepers read the others' slots
            info={"keep": self.keep},
            reserve_if=self._sends,  # a rank that only keeps writes nothing: its segment costs no memory
        )
        self.keepers = [r for r, info in enumerate(everyone) if info["keep"]]
        if own is None:
            self.transport = "collective"
            return
        self.transport = "shm"
        self._segments = peers
        if self._sends(everyone):  # keep its slots
            self._own = own
        else:
            own.close()

    def _sends(self, everyone: list[dict[str, Any]]) -> bool:
        """Whether this rank fills slots: some other rank keeps what it sends."""
        return any(info["keep"] for r, info in enumerate(everyone) if r != self.rank)

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        if self._own is not None:
            self._own.close()
            self._own = None
        self._send = self._recv = None

    # -- streaming ---------------------------------------------------------------------------------

    def gather(
        self,
        shard_numel: int,
        dtype: torch.dtype,
        pieces: Sequence[Piece],
        deliver: Callable[[int, torch.Tensor], None] | None,
    ) -> None:
        """Send this rank's ``pieces`` of a flat tensor whose shards have ``shard_numel`` elements.

        On keeping ranks ``deliver(flat_start, data)`` is called until every element of the padded flat
        tensor was delivered once (``data`` is 1-D and only valid during the call; uncovered parts of a
        shard arrive as zeros). Other ranks pass ``deliver=None``.
        """
        if self.keep:
            assert deliver is not None
            base = self.rank * shard_numel
            for offset, t in pieces:
                if t.numel():
                    deliver(base + offset, t)
        if self.world == 1 or not self.keepers or shard_numel == 0:
            return
        chunk = max(1, self.chunk_bytes // dtype.itemsize)
        for c0 in range(0, shard_numel, chunk):
            c1 = min(shard_numel, c0 + chunk)
            if self.transport == "shm":
                self._shm_step(c0, c1, dtype, pieces, deliver, shard_numel)
            else:
                self._collective_step(c0, c1, dtype, pieces, deliver, shard_numel)

    def _shm_step(
        self,
        c0: int,
        c1: int,
        dtype: torch.dtype,
        pieces: Sequence[Piece],
        deliver: Callable[[int, torch.Tensor], None] | None,
        shard_numel: int,
    ) -> None:
        slot = self._step % 2
        self._step += 1
        if self._own is not None:
            _fill(self._own.slot(slot, self.chunk_bytes, c1 - c0, dtype), c0, pieces)
        dist.barrier(group=self.group)
        if deliver is not None:
            for r, seg in self._segments.items():
                deliver(r * shard_numel + c0, seg.slot(slot, self.chunk_bytes, c1 - c0, dtype))

    def _collective_step(
        self,
        c0: int,
        c1: int,
        dtype: torch.dtype,
        pieces: Sequence[Piece],
        deliver: Callable[[int, torch.Tensor], None] | None,
        shard_numel: int,
    ) -> None:
        n = c1 - c0
        chunk = max(1, self.chunk_bytes // dtype.itemsize)
        whole = pieces[0][1] if len(pieces) == 1 and pieces[0][0] == 0 else None
        if whole is not None and whole.numel() >= c1 and whole.dtype == dtype and whole.device == self.device:
            send = whole[c0:c1]  # the shard itself: no copy
        else:
            if self._send is None or self._send.dtype != dtype or self._send.numel() < chunk:
                self._send = torch.empty(chunk, dtype=dtype, device=self.device)
            send = self._send[:n]
            _fill(send, c0, pieces)
        gather_to_one = len(self.keepers) == 1 and str(dist.get_backend(self.group)) == "gloo"
        recv: torch.Tensor | None = None
        if deliver is not None or not gather_to_one:
            if self._recv is None or self._recv.dtype != dtype or self._recv.numel() < chunk * self.world:
                self._recv = torch.empty(chunk * self.world, dtype=dtype, device=self.device)
            recv = self._recv[: n * self.world]
        parts = [_wire(r) for r in recv.chunk(self.world)] if recv is not None else None
        if gather_to_one:
            group: Any = self.group if self.group is not None else dist.group.WORLD
            dst = dist.get_global_rank(group, self.keepers[0])
            dist.gather(_wire(send), parts, dst=dst, group=self.group)
        else:
            assert parts is not None
            dist.all_gather(parts, _wire(send), group=self.group)
        if deliver is not None:
            assert recv is not None
            for r in range(self.world):
                if r != self.rank:
                    deliver(r * shard_numel + c0, recv[r * n : (r + 1) * n])


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What the backend moves for ``t`` (1-D, contiguous): its bytes, or a complex one's pairs of floats."""
    wire = as_wire(t)
    return torch.view_as_real(wire) if wire.is_complex() else wire


def _fill(dst: torch.Tensor, c0: int, pieces: Sequence[Piece]) -> None:
    """Write shard elements ``[c0, c0 + len(dst))`` from ``pieces`` (sorted by offset) into ``dst``; zeros
    in the gaps (padding, parameters without state)."""
    c1 = c0 + dst.numel()
    pos = c0  # everything before it is written
    for offset, t in pieces:
        a, b = max(c0, offset), min(c1, offset + t.numel())
        if b <= a:
            continue
        if a > pos:
            dst[pos - c0 : a - c0].zero_()
        dst[a - c0 : b - c0].copy_(t[a - offset : b - offset])
        pos = b
    if pos < c1:
        dst[pos - c0 :].zero_()


class UnitOutputs:
    """Full-shape output tensors for some parameters of a unit, filled by delivered flat ranges.

    Large outputs are handed to ``prefault`` (see [Note: prefaulting outputs]) when one is given.
    """

    def __init__(
        self,
        layout: FlatLayout,
        wanted: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        prefault: Prefaulter | None = None,
    ) -> None:
        self.offsets = list(layout.offsets)
        self.numels = list(layout.numels)
        self.tensors: dict[int, torch.Tensor] = {}
        for i in wanted:
            if device.type == "cpu" and prefault is not None:
                self.tensors[i] = empty_mapped(layout.shapes[i], dtype)
            else:
                self.tensors[i] = torch.empty(layout.shapes[i], dtype=dtype, device=device)
            if prefault is not None:
                prefault.add(self.tensors[i])

    def deliver(self, start: int, data: torch.Tensor) -> None:
        end = start + data.numel()
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while i < len(self.offsets) and self.offsets[i] < end:
            out = self.tensors.get(i)
            if out is not None:
                a, b = max(start, self.offsets[i]), min(end, self.offsets[i] + self.numels[i])
                if b > a:
                    out.view(-1)[a - self.offsets[i] : b - self.offsets[i]].copy_(data[a - start : b - start])
            i += 1


@dataclass
class GatherItem:
    """One flat tensor to gather: a unit's parameters, or one optimizer-state key laid out like them."""

    group: Any  # the unit's shard group
    device: torch.device  # where the shards live
    layout: FlatLayout
    dtype: torch.dtype
    wanted: list[int]  # indices (in ``layout``) of the tensors the keepers get back
    pieces: list[Piece] = field(default_factory=list)  # this rank's shard, by offset
    out_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # per index in ``layout``: the state-dict keys its tensor goes under (a model's items; empty otherwise)
    labels: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # per index in ``layout``: the tensor's layout where it is a tensor-parallel piece of a bigger tensor, which
    # the keepers get whole (see [Note: tensor parallelism])
    tensor_parallel: dict[int, Any] = field(default_factory=dict)


def _gathers_data_parallel(items: Sequence[GatherItem], keep: bool) -> bool:
    """Whether this rank receives the data-parallel gathers: it keeps, or (for a tensor-parallel model) one of its
    tensor-parallel peers does, whose whole tensors it helps assemble. Collective over that group."""
    layout = next((t for it in items for t in it.tensor_parallel.values()), None)
    if layout is None or layout.mesh.size() == 1:
        return keep
    flags: list[Any] = [None] * layout.mesh.size()
    dist.all_gather_object(flags, keep, group=layout.group)
    return any(flags)


def _whole(item: GatherItem, tensors: dict[int, torch.Tensor], keep: bool) -> dict[int, torch.Tensor]:
    """``tensors`` (one item's, gathered over its data-parallel group) with tensor-parallel pieces made whole over
    their tensor-parallel group, in ``wanted`` order on every peer; empty where this rank does not keep."""
    out: dict[int, torch.Tensor] = {}
    for i, t in tensors.items():
        layout = item.tensor_parallel.get(i)
        if layout is not None:
            t = layout.full(t.to(item.device)).to(item.out_device)
        if keep:
            out[i] = t
    return out


def gather_items(
    items: Sequence[GatherItem], keep: bool, chunk_bytes: int | None = None
) -> list[dict[int, torch.Tensor]]:
    """Gather every item; returns, per item, ``{index in layout: full tensor}`` (empty where not kept).

    All ranks call it with items in the same order (they do when they walk units in order); see
    [Note: streamed full-state gathers].
    """
    results: list[dict[int, torch.Tensor]] = [{} for _ in items]
    channels: dict[tuple[int, torch.device, bool], list[int]] = {}
    for i, item in enumerate(items):
        channels.setdefault((id(item.group), item.device, item.layout.world_size == 1), []).append(i)
    gathers = _gathers_data_parallel(items, keep)
    for idxs in channels.values():
        outs = _gather_channel([items[i] for i in idxs], gathers, chunk_bytes)
        for i, out in zip(idxs, outs, strict=True):
            results[i] = out
    if gathers and any(it.tensor_parallel for it in items):
        results = [_whole(it, out, keep) for it, out in zip(items, results, strict=True)]
    return results


def _gather_channel(
    items: Sequence[GatherItem], keep: bool, chunk_bytes: int | None
) -> list[dict[int, torch.Tensor]]:
    group, device = items[0].group, items[0].device
    prefault = Prefaulter()
    outputs = [
        UnitOutputs(it.layout, it.wanted, it.dtype, it.out_device, prefault) if keep else None for it in items
    ]
    with prefault:
        stream = FlatStream(group, keep, device, chunk_bytes, local=items[0].layout.world_size == 1)
        try:
            for it, out in zip(items, outputs, strict=True):
                stream.gather(it.layout.shard_numel, it.dtype, it.pieces, out.deliver if out else None)
        finally:
            stream.close()
    return [dict(out.tensors) if out is not None else {} for out in outputs]


def gather_by_unit(
    items: Sequence[GatherItem],
    keep: bool,
    consume: Callable[[int, dict[int, torch.Tensor]], None],
    chunk_bytes: int | None = None,
) -> None:
    """Gather the items one unit at a time (the items of one flat parameter share its layout): the outputs of a
    unit's items are allocated, filled, handed to ``consume(item index, {index in layout: full tensor})`` (empty
    where not kept) and dropped before the next unit's. One stream per group stays open throughout.

    All ranks call it with items in the same order (see [Note: streamed full-state gathers]).
    """
    units: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        units.setdefault(id(item.layout), []).append(i)
    whole, keep = keep, _gathers_data_parallel(items, keep)  # see [Note: tensor parallelism]
    streams: dict[tuple[int, torch.device, bool], FlatStream] = {}
    try:
        for unit in units.values():
            prefault = Prefaulter()
            outputs = {
                i: UnitOutputs(
                    items[i].layout, items[i].wanted, items[i].dtype, items[i].out_device, prefault
                )
                if keep
                else None
                for i in unit
            }
            with prefault:
                for i in unit:
                    item, out = items[i], outputs[i]
                    local = item.layout.world_size == 1
                    key = (id(item.group), item.device, local)
                    stream = streams.get(key)
                    if stream is None:  # opened collectively, at the same point on every rank
                        stream = streams[key] = FlatStream(item.group, keep, item.device, chunk_bytes, local)
                    stream.gather(
                        item.layout.shard_numel, item.dtype, item.pieces, out.deliver if out else None
                    )
            for i in unit:
                out = outputs.pop(i)
                tensors = dict(out.tensors) if out is not None else {}
                if items[i].tensor_parallel and keep:
                    tensors = _whole(items[i], tensors, whole)
                consume(i, tensors)
                del out, tensors
    finally:
        for stream in streams.values():
            stream.close()
