"""A unit's gradient path: from autograd's per-parameter gradients to the parameters' ``.grad`` views of the
gradient shard, through the reduce-scatter (and the all-reduce across replicas), ``no_sync`` accumulation,
mixed-precision casts and CPU offload.

:class:`UnitGradients` holds that state and those steps; :class:`~flatshard.engine.handle.FlatParamHandle`
(the gather path: shard, gathered flat parameter, views) inherits them, and the runtime's post-backward
hook drives them (``flatshard.engine.runtime``). What it reads of the handle (layout, groups, precision,
the trainable parameters) is declared below.

[Note: gradients of a unit]
The trainable views are the outputs of one ``_UnflattenViews`` node (``flatshard.engine.handle``), whose
only differentiable input is ``grad_anchor``, a scalar leaf of the handle's own. Autograd runs the node
once all the views' gradients are complete; its backward keeps those per-parameter tensors on the handle
and gives the anchor a zero. The anchor's post-accumulate hook then fires exactly once per backward, after
every node of the unit (also when the unit ran more than once in forward), and is the unit's
post-backward. There the gradient is reduced: packed into one flat buffer for the collectives that need
one, or, where the transport reads it piece by piece (the shared-memory one;
:class:`~flatshard.engine.transport.pieces.FlatPieces`), so the unsharded gradient exists once, not twice
(autograd's tensors plus a packed copy), and is freed as soon as the transport has read it.

[Note: reducing only what trains]
Trainable parameters come first in the flat parameter (see [Note: frozen parameters]), so the gradient is
zero past the *trainable extent* ``T``, the end of the last trainable parameter. A reduction therefore moves
only the start of each rank's shard, ``chunk = min(shard_len, T)`` elements of it: the gradient to reduce is
laid out as ``world`` chunks, chunk ``r`` holding elements ``[r * shard_len, r * shard_len + chunk)`` of the
flat gradient, and the reduce-scatter hands each rank its chunk, whose first ``_grad_numel`` elements are the
part of its gradient shard it keeps. A unit whose adapters hold 1% of its elements reduces 1% of its size (and
on one rank of a shard group, or under ``NO_SHARD``, all-reduces only ``[0, T)``); with every parameter
trainable the chunk is the whole shard and nothing changes. ``no_sync`` keeps its unsharded gradient in the
same layout, so it holds memory for the trainable extent only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.flat_param import FlatLayout, ShardInfo
from flatshard.engine.precision import UnitPrecision, reduce_divisors
from flatshard.engine.step.host_shard import HostShard
from flatshard.engine.transport.comm import InFlight, Pending
from flatshard.engine.transport.interface import Transport
from flatshard.engine.transport.pieces import FlatPieces
from flatshard.engine.transport.streams import CommContext

__all__ = ["UnitGradients", "set_grad", "used_anywhere"]


def _reduce_scatter_into(
    handle: UnitGradients, out: torch.Tensor, full: torch.Tensor | FlatPieces
) -> Pending:
    return handle.transport.reduce_scatter(out, full, handle.where)


def _all_reduce_into(handle: UnitGradients, out: torch.Tensor, full: torch.Tensor | FlatPieces) -> Pending:
    return handle.transport.all_reduce(out, handle.where)


def _weak_flat(t: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    """A weak reference to the 1-D tensor ``t`` that lives as long as views of it do.

    Views keep their *base* alive, not an intermediate view: a tensor that is itself a view (a mapped
    block is ``frombuffer(...).view(shape)``) dies with its last Python reference while the parameters'
    ``.grad`` views of it live on. So the base is referenced, and ``t`` is rebuilt from it on demand.
    """
    base = t if t._base is None else t._base
    ref = weakref.ref(base)
    numel, offset = t.numel(), t.storage_offset()
    if t.dim() != 1 or (numel > 1 and t.stride(0) != 1):
        raise ValueError(f"expected a contiguous 1-D gradient shard, got shape {tuple(t.shape)}.")

    def get() -> torch.Tensor | None:
        alive = ref()
        return None if alive is None else alive.as_strided((numel,), (1,), offset)

    return get


def set_grad(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also for a gradient kept in a lower precision than the parameter.

    Autograd refuses a ``.grad`` of another dtype; a placeholder of the parameter's dtype (no memory:
    all strides zero) is assigned instead and its data swapped for the low-precision gradient.
    """
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    placeholder = torch.empty(1, dtype=param.dtype, device=grad.device).expand(grad.shape)
    param.grad = placeholder
    param.grad.data = grad


class UnitGradients:
    """The gradient state and steps of one unit (see the module notes); a base of ``FlatParamHandle``."""

    # what the gradient path reads of the handle (set by its __init__)
    params: list[nn.Parameter]
    requires_grad: list[bool]
    _trainable: list[int]
    _grad_numel: int
    _shard_len: int
    _reduce_chunk: int
    _trainable_is_prefix: bool
    _trainable_end: int
    dtype: torch.dtype
    layout: FlatLayout
    shard_infos: tuple[ShardInfo, ...]
    shard_world: int
    replicate_world: int
    device: torch.device
    precision: UnitPrecision
    offload: bool
    host: HostShard | None  # cpu_offload="optimizer": the unit's host copies (see [Note: optimizer offload])
    transport: Transport
    grad_anchor: torch.Tensor
    _sharded: torch.Tensor
    _flat: torch.Tensor
    where: tuple[str, str, int] | None

    if TYPE_CHECKING:

        def _shard_piece(self, source: torch.Tensor, i: int) -> torch.Tensor: ...

    def _init_gradients(self) -> None:
        """The gradient state of a unit with no backward yet."""
        self._view_grads: list[torch.Tensor | None] | None = None  # this backward's, until post-backward
        # The gradient shard (1-D, like _sharded). Held strongly only during a backward pass; between
        # passes the parameters' .grad views keep it alive, so zero_grad(set_to_none=True) frees it.
        self._sharded_grad: torch.Tensor | None = None
        self._sharded_grad_ref: Callable[[], torch.Tensor | None] = lambda: None
        # CPU offload: reduced gradient shards in host memory (1-D, the kept prefix), accumulated at the end
        # of backward once the CPU has waited for their copies (see [Note: CPU offload])
        self._host_grads: list[torch.Tensor] = []
        # no_sync: gradients stay unsharded and accumulate here, in the gradient dtype, until a backward
        # outside no_sync reduces them with its own (see [Note: no_sync]).
        self.sync_grads = True
        self._unsynced_grad: torch.Tensor | None = None
        # hybrid sharding: reduce across replicas (False: keep the shard group's sums in _replica_partial until a
        # backward that does; see [Note: replica reductions once per step])
        self.all_reduce_grads = True
        self._replica_partial: torch.Tensor | None = None
        self._grad_this_backward = False  # a reduced gradient was accumulated in this backward
        self._used: list[bool] = [False] * len(self.params)  # per param: gradient flowed into its view

    def stash_view_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Keep the trainable views' gradients of one :class:`_UnflattenViews` node until post-backward.

        A unit that ran twice in forward has two nodes: their gradients are added per parameter.
        """
        for i, grad in zip(self._trainable, grads, strict=True):
            if grad is not None:
                self._used[i] = True
        kept = self._view_grads
        if kept is None:
            self._view_grads = list(grads)
            return
        for k, grad in enumerate(grads):
            if grad is not None:
                kept[k] = grad if kept[k] is None else kept[k] + grad  # type: ignore[operator]

    def take_view_grads(self) -> list[torch.Tensor | None] | None:
        """The gradients kept by :meth:`stash_view_grads` since the last call (``None``: no node ran)."""
        grads, self._view_grads = self._view_grads, None
        if self.grad_anchor.grad is not None:
            self.grad_anchor.grad = None
        return grads

    def _pieces_to_reduce(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[int, torch.Tensor]]:
        """Each used gradient at its place in the reduction's layout (see [Note: reducing only what trains]):
        a gradient that crosses shards is split there, and the part in shard ``r`` at offset ``o`` of the
        flat parameter goes to ``r * chunk + (o - r * shard_len)``."""
        offsets, length, chunk = self.layout.offsets, self._shard_len, self._reduce_chunk
        out: list[tuple[int, torch.Tensor]] = []
        for i, grad in zip(self._trainable, grads, strict=True):
            if grad is None:
                continue
            flat, offset = grad.reshape(-1), offsets[i]
            while flat.numel():
                shard = offset // length
                part = flat[: (shard + 1) * length - offset]
                out.append((shard * chunk + offset - shard * length, part))
                flat, offset = flat[part.numel() :], offset + part.numel()
        return out

    def _packs_by_cat(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether the reduction's layout is the gradients one after another: every trainable parameter
        has a gradient of the flat dtype, they are the first parameters, and the layout keeps offsets
        (every shard's chunk is the whole shard)."""
        if not self._trainable_is_prefix or self._reduce_chunk != self._shard_len:
            return False
        dtype = self.precision.compute
        return all(grad is not None and grad.dtype == dtype for grad in grads)

    def _reduce_numel(self) -> int:
        """Elements of the unsharded gradient a reduction takes: ``chunk`` per rank of the shard group."""
        return self._reduce_chunk * self.shard_world

    def pack_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One flat gradient in the reduction's layout from the trainable views' gradients (``None``: not
        used, zeros); see [Note: reducing only what trains].

        The buffer is allocated here (on the compute stream) rather than by autograd, so large CPU
        buffers get huge pages (see [Note: huge pages for CPU buffers]).
        """
        flat = self.transport.empty_flat(self._reduce_numel(), self.precision.compute)
        if self._packs_by_cat(grads):  # one copy for the whole unit rather than one per parameter
            used = self._trainable_end
            torch.cat([grad.reshape(-1) for grad in grads], out=flat[:used])  # type: ignore[union-attr]
            if used < flat.numel():
                flat[used:].zero_()
            return flat
        return FlatPieces(flat.numel(), flat.dtype, self.device, self._pieces_to_reduce(grads)).materialize(
            flat
        )

    def gradient_to_reduce(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | FlatPieces:
        """What :meth:`reduce_grad` reduces: these gradients plus what ``no_sync`` kept.

        Left in autograd's per-parameter tensors (:class:`FlatPieces`) for a reduce-scatter that reads them in
        place (``Transport.takes_pieces``) and needs no cast and no scaling of them first; packed into one
        flat buffer otherwise.
        """
        reduce_dtype = self.precision.reduce
        pre, _ = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if (
            not self.has_unsynced
            and pre == 1.0
            and reduce_dtype == self.precision.compute
            and self.transport.takes_pieces()
        ):
            return FlatPieces(self._reduce_numel(), reduce_dtype, self.device, self._pieces_to_reduce(grads))
        flat = self.with_unsynced(self.pack_grads(grads))
        assert flat is not None
        return flat

    def keep_unsynced(self, flat_grad: torch.Tensor) -> None:
        """Inside ``no_sync``: add an unsharded flat gradient to the ones kept since the last reduction."""
        kept = self._kept_unsynced()
        if kept is None:
            self._unsynced_grad = flat_grad.to(self.precision.grad)  # a buffer of our own: no copy needed
        else:
            kept.add_(flat_grad)

    def with_unsynced(self, flat_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient to reduce now: ``flat_grad`` plus whatever ``no_sync`` kept (both may be missing)."""
        kept, self._unsynced_grad = self._kept_unsynced(), None
        if kept is None:
            return flat_grad
        if flat_grad is not None:
            kept.add_(flat_grad)
        return kept

    def _kept_unsynced(self) -> torch.Tensor | None:
        """What ``no_sync`` kept, in the reduction layout of the current trainable set: parameters frozen or
        unfrozen between micro-batches change it (a newly frozen parameter's part is dropped: it gets no
        gradient; a newly trainable one's starts at zero)."""
        kept = self._unsynced_grad
        if kept is None or kept.numel() == self._reduce_numel():
            return kept
        world, old, new = self.shard_world, kept.numel() // self.shard_world, self._reduce_chunk
        moved = torch.zeros(world * new, dtype=kept.dtype, device=kept.device)
        keep = min(old, new)
        moved.view(world, new)[:, :keep].copy_(kept.view(world, old)[:, :keep])
        self._unsynced_grad = moved
        return moved

    @property
    def has_unsynced(self) -> bool:
        return self._unsynced_grad is not None

    @property
    def keeps_unsharded(self) -> bool:
        """Whether a backward now keeps its gradient unsharded (``no_sync``, except under hybrid sharding)."""
        return not self.sync_grads and not self._hybrid

    @property
    def _hybrid(self) -> bool:
        return self.shard_world > 1 and self.replicate_world > 1

    @property
    def defers_replica_reduce(self) -> bool:
        """Whether a backward now keeps its shard group's sum instead of all-reducing it across replicas.

        [Note: replica reductions once per step]
        Under hybrid sharding a gradient is reduce-scattered inside the shard group (a node), then all-reduced
        across the replicas (between nodes). Accumulating micro-batches (``no_sync``, Fabric's
        ``no_backward_sync``, the Trainer's ``accumulate_grad_batches``, or :func:`set_requires_all_reduce`)
        needs the second only once: each micro-batch's reduce-scatter result is added to a partial sum of the
        shard's size (reduce dtype), and the first backward that reduces across replicas adds it to its own
        and all-reduces the total once. Gradient memory stays at the shard's size (``no_sync`` outside
        hybrid sharding keeps a whole unsharded gradient instead), and the bytes between nodes per optimizer
        step drop by the number of micro-batches. The gradients the parameters show are updated only by
        that backward.
        """
        return self._hybrid and not (self.sync_grads and self.all_reduce_grads)

    @property
    def has_replica_partial(self) -> bool:
        return self._replica_partial is not None

    def _keep_partial(self, reduced: torch.Tensor) -> None:
        """Add a shard group's reduced sum to the partial sum kept for the replica reduction (on the current
        stream). ``reduced`` may be a transport buffer of this pass: the first one is copied."""
        if self._replica_partial is None:
            self._replica_partial = reduced.clone()
        else:
            self._replica_partial.add_(reduced)

    def _with_partial(self, reduced: torch.Tensor) -> torch.Tensor:
        """``reduced`` plus the kept partial sum (in place), which is then dropped."""
        partial, self._replica_partial = self._replica_partial, None
        if partial is not None:
            reduced.add_(partial)
        return reduced

    def reduce_partial(self, streams: CommContext | None = None) -> None:
        """All-reduce the partial sum alone across replicas and accumulate it: a backward that reduces across
        replicas in which this unit took no part."""
        partial, self._replica_partial = self._replica_partial, None
        assert partial is not None
        if streams is not None and streams.is_cuda:
            streams.side_waits_compute(streams.post_backward)
            with streams.on(streams.post_backward):
                self.transport.all_reduce(partial, self.where).wait()
                host = self._copy_to_host(partial, None, streams) if self.offload else None
                event = streams.record(streams.post_backward)
            self.finish_grad(InFlight(Pending(partial, None), event, partial, host), streams, reduced=True)
        else:
            self.transport.all_reduce(partial, self.where, async_op=False)
            self.finish_grad(InFlight(Pending(partial, None), None, partial), streams, reduced=True)

    def reduce_grad(
        self, flat_grad: torch.Tensor | FlatPieces, streams: CommContext | None = None
    ) -> InFlight:
        """Start reducing an unsharded flat gradient to this rank's gradient shard (a SUM; see finish_grad).

        ``flat_grad`` is kept alive in the returned record until :meth:`finish_grad` has waited. Under
        mixed precision it is cast to the reduce dtype first, and part of the average is taken before
        the reduction in 16-bit dtypes (:func:`~flatshard.engine.precision.reduce_divisors`). Given as
        :class:`FlatPieces` (see :meth:`gradient_to_reduce`) it needs neither and is reduce-scattered.
        """
        if isinstance(flat_grad, FlatPieces):
            out = self.transport.empty_flat(self._reduce_chunk, flat_grad.dtype)
            return InFlight(_reduce_scatter_into(self, out, flat_grad), None, flat_grad)
        reduce_dtype = self.precision.reduce
        if flat_grad.dtype != reduce_dtype:
            flat_grad = flat_grad.to(reduce_dtype)
        pre, _ = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if pre != 1.0:
            flat_grad.div_(pre)
        collective: Callable[[UnitGradients, torch.Tensor, torch.Tensor], Pending] | None
        if self.shard_world == 1:
            out, collective = flat_grad, _all_reduce_into if self.replicate_world > 1 else None
        else:
            out = self.transport.empty_flat(self._reduce_chunk, reduce_dtype)  # on compute
            collective = _reduce_scatter_into
        if streams is None or not streams.is_cuda:
            pending = collective(self, out, flat_grad) if collective is not None else Pending(out, None)
            return InFlight(pending, None, flat_grad)
        if collective is None and not self.offload:
            return InFlight(Pending(out, None), None, flat_grad)
        # See [Note: stream overlap]: everything below is queued on the post-backward stream, after the
        # compute stream's work so far; the compute stream waits for its event in finish_grad.
        scratch = self._cast_scratch(out.dtype) if self.offload else None  # allocated on compute
        streams.side_waits_compute(streams.post_backward)
        with streams.on(streams.post_backward):
            pending = Pending(out, None)
            if collective is not None:
                pending = collective(self, out, flat_grad)
                pending.wait()  # the post-backward stream (not the CPU) waits for the collective
            deferred = self.defers_replica_reduce
            if deferred:  # see [Note: replica reductions once per step]
                self._keep_partial(out)
            elif self._hybrid:  # hybrid sharding: across shard groups
                self.transport.all_reduce(self._with_partial(out), self.where).wait()
            host = self._copy_to_host(out, scratch, streams) if self.offload and not deferred else None
            event = streams.record(streams.post_backward)
        keepalive = flat_grad if scratch is None else (flat_grad, scratch)
        return InFlight(pending, event, keepalive, host)

    def finish_grad(
        self, inflight: InFlight, streams: CommContext | None = None, reduced: bool = False
    ) -> None:
        """Wait for a reduction, average it and accumulate it into the parameters' gradients.

        With CPU offload the gradient shard is copied to host memory instead and accumulated by
        :meth:`accumulate_host_grads` once the CPU has waited for the copies (see [Note: CPU offload]).
        ``reduced``: already reduced across replicas (:meth:`reduce_partial`).
        """
        if inflight.event is not None and streams is not None:
            streams.wait(inflight.event)  # the compute stream: the reduction (and any copy to host) is done
            grad = inflight.pending.output
            if self.defers_replica_reduce and not reduced:  # kept by reduce_grad
                return
        else:
            grad = inflight.pending.wait()
            if self._hybrid and not reduced:  # on CUDA: issued by reduce_grad
                if self.defers_replica_reduce:  # see [Note: replica reductions once per step]
                    self._keep_partial(grad)
                    return
                self.transport.all_reduce(self._with_partial(grad), self.where, async_op=False)
        if self.offload:
            host = inflight.host if inflight.host is not None else self._copy_to_host(grad, None, streams)
            self._host_grads.append(host)
            return
        _, post = reduce_divisors(self.shard_world * self.replicate_world, grad.dtype)
        if grad.dtype != self.precision.grad:
            grad = grad.to(self.precision.grad)
        if post != 1.0:
            grad.div_(post)
        if self.host is not None:  # a copy to the host may still read the gradient shard
            self.host.before_grad_write(streams)
        self._accumulate(grad)
        if self.host is not None and self.precision.grad == self.dtype:
            # Start the copy to the host for the offloaded step now, overlapping the rest of backward (see [Note:
            # host copies and the streams]). A gradient kept in a lower precision is assigned through ``.data``,
            # where writes move no version counter, so it is copied at the step instead.
            assert self._sharded_grad is not None
            self.host.copy_grad(self._sharded_grad, streams)

    def _cast_scratch(self, reduce_dtype: torch.dtype) -> torch.Tensor | None:
        """A device buffer for casting a reduced shard to the gradient dtype before it is averaged (the
        order finish_grad uses without offload), or ``None`` when the copy to host can cast by itself."""
        _, post = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if post == 1.0 or reduce_dtype == self.precision.grad:
            return None
        return self.transport.empty_flat(self._grad_numel, self.precision.grad)

    def _copy_to_host(
        self, grad: torch.Tensor, scratch: torch.Tensor | None, streams: CommContext | None
    ) -> torch.Tensor:
        """The kept part of a reduced gradient shard, averaged, copied into a new host buffer.

        Runs on the current stream: on CUDA the post-backward one, where the copy does not block the CPU,
        and the buffer is valid only after the CPU has waited for that stream (see [Note: CPU offload]).
        ``grad`` (the reduction's own output) may be averaged in place.
        """
        _, post = reduce_divisors(self.shard_world * self.replicate_world, grad.dtype)
        part = grad[: self._grad_numel]
        if post != 1.0:
            if part.dtype != self.precision.grad:  # cast first, then average, as without offload
                part = part.to(self.precision.grad) if scratch is None else scratch.copy_(part)
            part.div_(post)
        if streams is not None:
            host = streams.host_empty(part.numel(), self.precision.grad)
        else:
            host = torch.empty(part.numel(), dtype=self.precision.grad)
        host.copy_(part, non_blocking=streams is not None and streams.is_cuda)
        return host

    @property
    def has_host_grads(self) -> bool:
        """Whether offloaded gradient shards wait for :meth:`accumulate_host_grads`."""
        return bool(self._host_grads)

    def accumulate_host_grads(self) -> None:
        """Accumulate the gradient shards copied to host memory in this backward into the gradient shard.

        Call only after the CPU has waited for the copies (``CommContext.sync_host`` on the post-backward
        stream, at the end of backward): see [Note: CPU offload].
        """
        grads, self._host_grads = self._host_grads, []
        for grad in grads:
            self._accumulate(grad)

    def _accumulate(self, grad: torch.Tensor) -> None:
        """Add a reduced gradient shard into ``_sharded_grad`` (gradients are assigned at end of backward).

        [Note: frozen parameters]
        Frozen parameters sit after the trainable ones in the flat parameter, so the trainable part of a
        rank's gradient shard is a prefix of it. Only that prefix is kept (a LoRA-style unit whose large
        frozen weights share it with small adapters keeps gradient memory for the adapters only); the rest
        of the reduced shard is freed at once. Frozen parameters never get a ``.grad``. ``requires_grad``
        may change later (unfreezing while training): the layout stays, and the kept part then reaches to
        the end of the last trainable parameter.
        """
        if grad.numel() != self._grad_numel:
            grad = grad[: self._grad_numel].clone()
        if self._grad_this_backward:  # a second reduction in the same backward (unit ran twice)
            assert self._sharded_grad is not None
            self._sharded_grad.add_(grad)
            return
        self._grad_this_backward = True
        trainable = self._trainable
        current = self._sharded_grad = self._sharded_grad_ref()
        if current is not None and current.numel() != grad.numel():  # the trainable set changed since
            current = None
        if current is None:  # accumulate into the new shard whatever gradients the parameters hold
            self._sharded_grad = grad
            for i in trainable:
                g = self.params[i].grad
                if g is not None:
                    piece = self._shard_piece(grad, i)
                    piece.add_(g.view_as(piece))
            return
        if all(self.params[i].grad is None for i in trainable):
            self._sharded_grad = grad
            return
        for i in trainable:
            p, mine = self.params[i], self._shard_piece(current, i)
            if p.grad is None:
                mine.zero_()
            elif p.grad.data_ptr() != mine.data_ptr() or p.grad.shape != mine.shape:
                mine.copy_(p.grad)  # the user replaced the gradient tensor: keep its values
        current.add_(grad)

    def sharded_grad(self) -> torch.Tensor | None:
        """The gradient shard (1-D, ``grad_numel`` elements), alive while some parameter's ``.grad`` views it."""
        return self._sharded_grad if self._sharded_grad is not None else self._sharded_grad_ref()

    @property
    def grad_numel(self) -> int:
        """Elements of this rank's gradient shard: its start up to the end of the last trainable parameter."""
        return self._grad_numel

    @property
    def grad_this_backward(self) -> bool:
        """Whether a reduced gradient was accumulated in the current backward pass."""
        return self._grad_this_backward

    def used_flags(self) -> list[bool]:
        """Per trainable parameter: did a gradient flow into it in this backward (on this rank)?"""
        return [self._used[i] for i, r in enumerate(self.requires_grad) if r]

    def assign_grads(self, used: Sequence[bool]) -> None:
        """Point ``.grad`` of parameters some rank used (or that already had a gradient) at the shard.

        ``used`` has one flag per trainable parameter, OR-ed over the ranks that share the unit, so every
        rank decides alike; a parameter nobody used keeps ``grad=None`` and optimizers skip it. So does one
        frozen since its views were made (Lightning's ``toggle_optimizer`` inside a step that is the root's
        forward): as if autograd had not computed its gradient.
        """
        assert self._sharded_grad is not None
        trainable = self._trainable
        for i, was_used in zip(trainable, used):
            p = self.params[i]
            if (not was_used and p.grad is None) or not p.requires_grad:
                continue
            view = self._shard_piece(self._sharded_grad, i)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                set_grad(p, view)
        self.reset_backward()

    def reset_backward(self) -> None:
        if self._sharded_grad is not None:
            self._sharded_grad_ref = _weak_flat(self._sharded_grad)
            self._sharded_grad = None
        self._grad_this_backward = False
        self._used = [False] * len(self.params)


def used_anywhere(handles: Sequence[Any]) -> list[list[bool]]:
    """OR each handle's per-parameter "received a gradient" flags over the ranks sharing it.

    One small all-reduce per group (usually one per backward), so ranks agree on which parameters keep
    ``grad=None``. All ranks run the same units (their forwards all-gather), so ``handles`` agree too.
    On CUDA it costs no host synchronization when every parameter got a gradient on this rank (the common
    case): the flags are copied from pinned memory and the result, known to be all ones, is not read.
    """
    flags = [h.used_flags() for h in handles]
    if not handles or not (dist.is_available() and dist.is_initialized()):
        return flags
    by_group: dict[tuple[int, int], list[int]] = {}
    for i, h in enumerate(handles):
        if h.shard_world > 1 or h.replicate_world > 1:
            by_group.setdefault((id(h.shard_group), id(h.replicate_group)), []).append(i)
    for members in by_group.values():
        first = handles[members[0]]
        local = [int(f) for i in members for f in flags[i]]
        packed = torch.tensor(local, dtype=torch.int32)
        if first.device.type == "cuda":  # queued behind the backward: no host sync to copy it over
            packed = packed.pin_memory().to(first.device, non_blocking=True)
        for group, size in (
            (first.shard_group, first.shard_world),
            (first.replicate_group, first.replicate_world),
        ):
            if size > 1 and packed.numel():
                dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        # MAX of flags that are all 1 here is all 1: the result need not be read back (a host sync on CUDA,
        # which would keep the CPU from queueing the optimizer step). Only a rank that left a parameter
        # without a gradient reads which ranks used it.
        values = local if all(local) else packed.tolist()
        for i in members:
            n = len(flags[i])
            flags[i], values = [bool(v) for v in values[:n]], values[n:]
    return flags
