"""Activation offload: the activations a unit saves for backward wait in host memory until its backward.

[Note: activation offload]
With ``activation_offload=True`` the tensors autograd saves inside a unit's forward leave the device when the
unit's forward returns and come back one unit ahead of the unit's backward, so the device holds about two
units' activations instead of all of them. It runs on torch's public saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``): the root pushes them when its training forward starts and
pops them when it returns, and the units' forward hooks say which unit each saved tensor belongs to. One push
per root rather than one per unit, so that what the root saves between units is seen too (see Records).

* **What moves.** A saved tensor on the compute device whose storage holds at least :data:`MIN_BYTES`
  (256 KiB; a smaller copy costs more in launch latency than its memory is worth). Parameters, views of a
  gathered flat parameter (gathered again for backward anyway) and of the root's parameters and buffers,
  tensor subclasses (DTensor, float8 tensors) and tensors on another device stay. What moves is the storage:
  a storage saved several times in one unit (the input of the q, k and v projections, three views of one
  output) moves once, and each saved tensor comes back as the same view of it.
* **Records.** Each unit's forward call fills one record. What the root saves itself before a unit starts
  goes into a *lead-in* record that travels with that unit: the inputs of a checkpointed unit are saved there
  (the checkpoint saves them before the unit's hooks run). What it saves after the last unit (a final norm,
  the head, the loss) stays on the device: its backward comes first. Such a record is handed back: each
  saved tensor then holds its own storage, so autograd frees them one by one, as without the offload.
  Autograd's saved tensors hold the records, and with them their host copies; the root holds a record
  only while its storages are on the device (in flight or brought back), and otherwise weakly.
* **Forward.** When a unit's forward returns (a lead-in: when its unit's forward starts), the ``offload``
  stream waits for the compute stream and copies the record's storages into one pinned host block. The
  device storages are held by reference until the compute stream has waited for that copy's event, which it
  does when the next unit's forward returns: one unit's copy overlaps the next unit's compute, and beside the
  unit computing at most the unit before it (and the computing unit's lead-in) are in flight. No
  ``record_stream``: the allocation rule of [Note: stream overlap] holds.
* **Backward.** When a unit's backward begins (its pre-backward hook), its records are copied back if they
  are not on the device yet, and so are those of the unit whose backward comes next in the recorded
  execution order (see [Note: execution order]): one unit ahead, on the ``reload`` stream, into device
  buffers allocated on the compute stream, after the ``reload`` stream waited for the compute stream and for
  the copy to host. The first tensor unpacked from a record makes the compute stream wait for that record's
  event. A record is dropped from the device when every tensor saved in it has been unpacked, when its unit's
  backward is done, and at the end of backward; a tensor asked for after that (a second backward with
  ``retain_graph``) is copied back there and then (counted in :attr:`OffloadStats.late`). So backward holds
  the unit computing and the one prefetched.
* **Activation checkpointing.** Inside a checkpointed module the checkpoint's own saved-tensor hooks come
  first, so what reaches these is what the checkpoint saves outside them: the module's inputs.
* **CPU and meta.** On a CPU compute device nothing needs to move: every saved tensor, of any size, goes
  through the records and their phases (what the CPU tests exercise), and each record is handed back when
  its forward ends instead of copied, so memory and results are those without the offload. On the meta device
  (the estimator) the same, with a GPU's size threshold, so an estimate counts what a GPU would move.
* **Checked.** ``tests/fake_streams.py`` replays the CUDA paths on CPU and checks every wait above (see
  [Note: checking streams on CPU]); ``tests/gpu`` runs them under torch's CUDA sanitizer.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from flatshard.engine.log_once import log_once

__all__ = ["MIN_BYTES", "ActivationOffload", "OffloadStats"]

log = logging.getLogger(__name__)

# Smallest storage moved to host memory where a copy is needed: see [Note: activation offload].
MIN_BYTES = 256 * 1024


class _Phase(enum.Enum):
    COLLECTING = "collecting"  # its forward runs: it holds the storages saved so far, on the device
    OFFLOADING = "offloading"  # copies to host issued; device storages held until the compute stream waited
    ON_HOST = "on_host"  # the host copies only (CPU: the saved tensors hold the storages where they are)
    ON_DEVICE = (
        "on_device"  # copied back beside the host copies (the compute stream waits at the first unpack)
    )
    KEPT = "kept"  # stays on the device (the root's tail): its saved tensors hold the storages


class _Record:
    """The storages one unit's forward call (or the root before it) saved."""

    __slots__ = (
        "__weakref__",
        "device",
        "host",
        "index",
        "lead_in",
        "nbytes",
        "offloaded",
        "owner",
        "phase",
        "reloaded",
        "saved",
        "unpacked",
        "views",
        "waited",
    )

    def __init__(self, owner: Any, lead_in: bool = False) -> None:
        self.owner = owner  # the unit whose backward needs it (a lead-in: the unit it precedes)
        self.lead_in = lead_in
        self.phase = _Phase.COLLECTING
        self.device: list[torch.Tensor] = []  # each storage as 1-D uint8 on the compute device
        self.host: list[torch.Tensor] = []  # their copies, slices of one pinned block (CUDA)
        self.index: dict[int, int] = {}  # id(storage) -> its position, while collecting
        self.saved: list[weakref.ref[_Saved]] = []  # its saved tensors, while collecting
        self.nbytes = 0
        self.views = 0  # saved tensors that refer to it
        self.unpacked = 0  # of them handed back since it last came back to the device
        self.offloaded: Any = None  # event after the copies to host (CUDA)
        self.reloaded: Any = None  # event after the copies back (CUDA)
        self.waited = True  # the compute stream waited for ``reloaded``


class _Saved:
    """What autograd keeps instead of a moved tensor: its record, the storage's place there, and its view.

    ``keep``: the storage itself (1-D uint8), for a record whose storages stay where they are (on a CPU device,
    and the root's tail): then each saved tensor holds its own storage, and autograd frees them one by one, as
    it does without the offload (see :meth:`ActivationOffload._hand_back`).
    """

    __slots__ = ("__weakref__", "dtype", "keep", "offset", "record", "size", "slot", "stride")

    def __init__(self, record: _Record, slot: int, t: torch.Tensor) -> None:
        self.record = record
        self.slot = slot
        self.keep: torch.Tensor | None = None
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


@dataclass
class OffloadStats:
    """What a root's activation offload did (read it with ``flatshard.engine.activation_offload_stats``).

    Attributes:
        packed: saved tensors the hooks saw.
        moved: of them, those put in a record (moved to host memory where the device is not the CPU).
        offloaded_bytes: bytes of storages put in records, over all training forwards.
        records: records copied to host memory (a no-op copy on CPU).
        prefetched: records copied back one unit ahead of their unit's backward.
        reloaded: records copied back when their own unit's backward began (no prefetch for it).
        late: records copied back when a tensor of theirs was unpacked after they had left the device.
        unpacked: saved tensors handed back from records.
        max_units_in_flight: in forward, the most units with copies to host memory not yet waited for.
        max_units_back: in backward, the most units with records back on the device at once.
        unit_bytes: bytes each unit's records held in the last training forward (by unit path, lead-ins with
            their unit).
    """

    packed: int = 0
    moved: int = 0
    offloaded_bytes: int = 0
    records: int = 0
    prefetched: int = 0
    reloaded: int = 0
    late: int = 0
    unpacked: int = 0
    max_units_in_flight: int = 0
    max_units_back: int = 0
    unit_bytes: dict[str, int] = field(default_factory=dict)


def _units(records: list[_Record]) -> int:
    return len({id(r.owner) for r in records})


_ALIGN = 512  # each storage's place in a record's block: the caching allocator's alignment


def _packed(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of ``sizes`` bytes laid out one after the other in one block, each aligned; the block's size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, end


class ActivationOffload:
    """A root's activation offload (see [Note: activation offload]); inert when the option is off.

    ``ctx`` is the root's ``RootContext``: its ``root``, ``states``, ``handles``, ``streams`` and ``order`` are
    read as they are at each call (a stream recorder may swap the streams between steps).
    """

    min_bytes: int = MIN_BYTES  # where copies are needed; tests of the CUDA protocol on CPU lower it

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.enabled: bool = bool(ctx.root.options.activation_offload)
        self.stats = OffloadStats()
        self.device: torch.device = next((h.device for h in ctx.handles), torch.device("cpu"))
        # The flat parameters' storages (the same storage objects for the model's life, resized by gathers and
        # frees): views of them are never moved.
        self._params = {id(t.untyped_storage()): t for h in ctx.handles for t in (h.flat, h.sharded)}
        self._fixed: dict[int, Any] = {}  # those, and the root's parameters and buffers in this forward
        self._hooks: Any = None  # the saved-tensor hooks pushed by the root's forward
        self._stack: list[_Record] = []  # records of the units whose forward runs, innermost last
        self._lead_in = _Record(None, lead_in=True)
        # id(unit) -> its records in this iteration, held weakly: autograd's saved tensors hold them, and a record
        # whose saved tensors autograd freed goes with its host copies
        self._by_unit: dict[int, list[weakref.ref[_Record]]] = {}
        self._in_flight: list[_Record] = []  # OFFLOADING records
        self._back: list[_Record] = []  # ON_DEVICE records
        self._began: set[int] = set()  # id() of the units whose backward began in this pass
        self._copies = False  # copies are made (CUDA, or its recording fake)
        self._min = 0
        if self.enabled and all(s is ctx.root for s in ctx.states):
            log_once(
                log,
                ("activation_offload", type(ctx.root.module).__name__),
                "activation_offload=True: %s is the only unit, so nothing is offloaded (the root's own "
                "activations stay on the device). HINT: set auto_wrap_policy (e.g. the transformer block class).",
                type(ctx.root.module).__name__,
                level=logging.WARNING,
            )

    # ------------------------------------------------------------------ forward
    def enter(self, unit: Any, tracked: bool) -> None:
        """A unit's forward starts (the pre-forward hook): the root's training forward pushes the hooks, a unit
        inside it opens its record."""
        if not self.enabled or not tracked:
            return
        if unit is self.ctx.root:
            self._begin_forward()
            return
        if self._hooks is None:
            return
        if not self._stack and self._lead_in.views:  # what the root saved before this unit goes with it
            lead = self._lead_in
            self._lead_in = _Record(None, lead_in=True)
            self._keep(lead, unit)
            self._offload(lead)
        self._stack.append(_Record(unit))

    def leave(self, unit: Any) -> None:
        """A unit's forward returned (the post-forward hook): its record goes to host memory; the copies of the
        units before it are waited for by the compute stream. The root's forward pops the hooks."""
        if not self.enabled:
            return
        if unit is self.ctx.root:
            self._end_forward()
            return
        if not any(r.owner is unit for r in self._stack):
            return
        while self._stack:  # a unit whose forward raised may have left its record open above
            record = self._stack.pop()
            if record.owner is unit:
                break
        if record.views:
            self._keep(record, unit)
            self._offload(record)
        for old in [r for r in self._in_flight if r.owner is not unit]:
            self._release(old)

    def _begin_forward(self) -> None:
        self._end_forward()
        self.release_all()
        self._by_unit.clear()
        self._began.clear()
        self._stack.clear()
        self._lead_in = _Record(None, lead_in=True)
        self.stats.unit_bytes = {}
        root = self.ctx.root.module
        self._fixed = dict(self._params)
        for t in (*root.parameters(), *root.buffers()):
            self._fixed[id(t.untyped_storage())] = t
        self._copies = bool(self.ctx.streams.is_cuda)
        self._min = self.min_bytes if self._copies or self.device.type != "cpu" else 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def _end_forward(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        for record in [*self._stack, self._lead_in]:  # the root's tail (and records a raising forward left)
            self._hand_back(record, _Phase.KEPT)
        self._stack.clear()
        self._lead_in = _Record(None, lead_in=True)
        self._fixed = {}

    def _keep(self, record: _Record, unit: Any) -> None:
        record.owner = unit
        self._by_unit.setdefault(id(unit), []).append(weakref.ref(record))
        path = str(getattr(unit, "path", "?"))
        self.stats.unit_bytes[path] = self.stats.unit_bytes.get(path, 0) + record.nbytes

    # ------------------------------------------------------------------ the hooks
    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.packed += 1
        if (
            type(t) is not torch.Tensor  # a Parameter, a subclass
            or t.device != self.device
            or t.layout is not torch.strided
            or t.is_conj()
            or t.is_neg()
        ):
            return t
        storage = t.untyped_storage()
        key, nbytes, itemsize = id(storage), storage.nbytes(), t.element_size()
        if key in self._fixed or nbytes == 0 or nbytes < self._min or nbytes % itemsize:
            return t
        record = self._stack[-1] if self._stack else self._lead_in
        slot = record.index.get(key)
        if slot is None:
            slot = record.index[key] = len(record.device)
            whole = t.detach().as_strided((nbytes // itemsize,), (1,), 0).view(torch.uint8)
            record.device.append(whole)
            record.nbytes += nbytes
        record.views += 1
        self.stats.moved += 1
        saved = _Saved(record, slot, t)
        record.saved.append(weakref.ref(saved))
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved  # type: ignore[no-any-return]  # a tensor left as it was
        record = saved.record
        if record.phase is _Phase.ON_HOST:
            self._copy_back(record)
            self.stats.late += 1
        if not record.waited:
            self.ctx.streams.wait(record.reloaded)
            record.waited = True
        storage = saved.keep if saved.keep is not None else record.device[saved.slot]
        typed = storage.view(saved.dtype)  # a slice of a record's block: offsets count from the block's start
        out = typed.as_strided(saved.size, saved.stride, typed.storage_offset() + saved.offset)
        self.stats.unpacked += 1
        if record.phase in (_Phase.OFFLOADING, _Phase.ON_DEVICE):
            record.unpacked += 1
            if record.unpacked >= record.views:
                self._release(record)
        return out

    # ------------------------------------------------------------------ copies
    def _offload(self, record: _Record) -> None:
        """Copy ``record``'s storages to host memory on the offload stream (CPU: they are there already)."""
        self.stats.records += 1
        self.stats.offloaded_bytes += record.nbytes
        if not self._copies:
            self._hand_back(record, _Phase.ON_HOST)
            return
        record.index.clear()  # storage ids are only unique while the storages are held
        record.saved = []
        streams = self.ctx.streams
        streams.side_waits_compute(streams.offload)  # the compute stream made these tensors
        with streams.on(streams.offload):
            offsets, span = _packed([d.numel() for d in record.device])
            block = streams.host_empty(span, torch.uint8)  # one pinned block per record
            record.host = [block[o : o + d.numel()] for o, d in zip(offsets, record.device, strict=True)]
            for host, device in zip(record.host, record.device, strict=True):
                host.copy_(device, non_blocking=True)
        record.offloaded = streams.record(streams.offload)
        record.phase = _Phase.OFFLOADING
        self._in_flight.append(record)
        self.stats.max_units_in_flight = max(self.stats.max_units_in_flight, _units(self._in_flight))

    def _hand_back(self, record: _Record, phase: _Phase) -> None:
        """``record``'s storages stay where they are: each saved tensor of it holds its own storage from now on,
        and the record none, so autograd frees each when it is done with it (on a CPU device, and for what the root
        saves after its last unit)."""
        for ref in record.saved:
            saved = ref()
            if saved is not None:
                saved.keep = record.device[saved.slot]
        record.device, record.saved, record.phase = [], [], phase
        record.index.clear()

    def _copy_back(self, record: _Record) -> bool:
        """Copy ``record`` back to the device on the reload stream, if it has left it (CPU: nothing to copy)."""
        if record.phase is not _Phase.ON_HOST or not record.views:
            return False
        if self._copies:
            streams = self.ctx.streams
            # one block, allocated on the compute stream before the reload stream writes it (see [Note: stream
            # overlap]), laid out as the host block
            block = torch.empty(
                record.host[0].untyped_storage().nbytes(), dtype=torch.uint8, device=self.device
            )
            device = [block[h.storage_offset() : h.storage_offset() + h.numel()] for h in record.host]
            streams.side_waits_compute(streams.reload)
            streams.wait(record.offloaded, streams.reload)  # the host copy is complete
            with streams.on(streams.reload):
                for d, h in zip(device, record.host, strict=True):
                    d.copy_(h, non_blocking=True)
            record.reloaded, record.waited = streams.record(streams.reload), False
        else:
            device = []  # each saved tensor holds its storage (see _hand_back)
        record.device, record.unpacked, record.phase = device, 0, _Phase.ON_DEVICE
        self._back.append(record)
        self.stats.max_units_back = max(self.stats.max_units_back, _units(self._back))
        return True

    def _release(self, record: _Record) -> None:
        """Drop ``record``'s device storages, once the compute stream waited for the copy that used them."""
        streams = self.ctx.streams
        if record.phase is _Phase.OFFLOADING:
            streams.wait(record.offloaded)  # the offload stream read them
            self._in_flight.remove(record)
        elif record.phase is _Phase.ON_DEVICE:
            if not record.waited:
                streams.wait(record.reloaded)  # the reload stream wrote them
            self._back.remove(record)
        else:
            return
        record.device, record.waited, record.phase = [], True, _Phase.ON_HOST

    def release_all(self) -> None:
        for record in [*self._in_flight, *self._back]:
            self._release(record)

    # ------------------------------------------------------------------ backward
    def before_backward(self, unit: Any, first_time: bool) -> None:
        """A unit's backward begins (its pre-backward hook): its records come back, and those of the unit whose
        backward comes next (one unit ahead)."""
        if not self.enabled or not first_time:
            return
        self._began.add(id(unit))
        for record in self._records_of(unit):
            self.stats.reloaded += self._copy_back(record)
        following = self.ctx.order.next_backward(unit)
        if following is not None and id(following) not in self._began:
            for record in self._records_of(following):
                self.stats.prefetched += self._copy_back(record)

    def unit_done(self, unit: Any) -> None:
        """A unit's backward is done (its gradients are complete): its own records leave the device."""
        if self.enabled:
            for record in self._records_of(unit):
                if not record.lead_in:  # a lead-in is the root's: its backward comes after the unit's
                    self._release(record)

    def _records_of(self, unit: Any) -> Iterator[_Record]:
        for ref in self._by_unit.get(id(unit), ()):
            record = ref()
            if record is not None:
                yield record

    def end_backward(self) -> None:
        """The end-of-backward callback: every record leaves the device; a new pass begins."""
        if self.enabled:
            self.release_all()
            self._by_unit.clear()
            self._began.clear()
            if self._hooks is not None:  # a backward inside the root's forward: what it saved so far stays
                self._hand_back(self._lead_in, _Phase.KEPT)
                self._lead_in = _Record(None, lead_in=True)
