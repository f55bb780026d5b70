"""FlatParamHandle: one unit's flat parameter, its storage states, gradient shard and parameter views.

[Note: original parameters as views]
The unit keeps the user's own ``nn.Parameter`` objects (so optimizers built before or after
``shard()`` and per-name param groups keep working). Their ``.data`` is swapped, never the objects:

- SHARDED: each parameter's data is its piece of the local shard, a view into ``_sharded``. With a
  shard group of one rank (NO_SHARD, or a single process) the piece is the whole parameter and keeps
  its shape; otherwise it is 1-D, possibly empty, the same rule on every rank so param groups agree.
  Gradients are views into the local gradient shard, laid out the same way.
- UNSHARDED (inside a unit's forward and backward): the module attributes are replaced by plain tensor
  views of ``_flat``, the gathered flat parameter. The trainable views come out of one autograd node
  (see [Note: gradients of a unit]).

[Note: gradients of a unit]
The trainable views are the outputs of one :class:`_UnflattenViews` node, whose only differentiable
input is ``grad_anchor``, a scalar leaf of the handle's own. Autograd runs the node once all the
views' gradients are complete; its backward keeps those per-parameter tensors on the handle and gives
the anchor a zero. The anchor's post-accumulate hook then fires exactly once per backward, after every
node of the unit (also when the unit ran more than once in forward), and is the unit's post-backward.
There the gradient is reduced: packed into one flat buffer for the collectives that need one, or, on
the shared-memory transport, read piece by piece (:class:`~flatshard.engine.transport.pieces.FlatPieces`), so
the unsharded gradient exists once, not twice (autograd's tensors plus a packed copy), and is freed as
soon as the transport has read it.

[Note: freeing gathered storage]
``_flat`` is allocated once and only its storage is resized: to zero when resharded, back to full when
gathered. Autograd saves views of ``_flat`` in forward; FULL_SHARD frees the storage after forward and
gathers into the same storage again before backward, so the saved views see the right values.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

from flatshard.engine.flat_param import FlatLayout, ShardInfo, flatten_tensors, split_flat
from flatshard.engine.precision import UnitPrecision, reduce_divisors
from flatshard.engine.transport import comm, memory, watchdog
from flatshard.engine.transport.limiter import AllGatherLimiter
from flatshard.engine.transport.pieces import FlatPieces
from flatshard.engine.transport.streams import CommContext
from flatshard.engine.wrap import Alias

__all__ = ["FlatParamHandle", "HandleState", "handle_of_param", "locate_params"]

_PARAM_TO_HANDLE = WeakIdKeyDictionary()  # Parameter -> FlatParamHandle, keyed by identity


def handle_of_param(param: torch.Tensor) -> FlatParamHandle | None:
    """The handle managing ``param``, or ``None`` for a parameter flatshard does not manage."""
    return _PARAM_TO_HANDLE.get(param)  # type: ignore[no-any-return]


def locate_params(params: list[torch.Tensor]) -> list[tuple[FlatParamHandle | None, int]]:
    """Each parameter's handle (``None`` when it is no unit's) and its index in that handle."""
    out: list[tuple[FlatParamHandle | None, int]] = []
    for p in params:
        handle = handle_of_param(p)
        out.append((handle, -1 if handle is None else handle.index_of(p)))
    return out


class _InFlight(NamedTuple):
    """A collective issued for a handle: its work, the side-stream event (CUDA) and what it reads."""

    pending: comm.Pending
    event: Any | None  # recorded on the side stream after the collective; None on CPU
    # inputs the side stream reads (one, or a tuple), alive until the compute stream has waited for ``event``
    keepalive: torch.Tensor | FlatPieces | tuple[torch.Tensor, ...] | None
    # CPU offload on CUDA: the host buffer the reduced gradient shard is being copied into, readable once
    # the CPU has waited for the post-backward stream (see [Note: CPU offload])
    host: torch.Tensor | None = None


def _reduce_scatter_into(
    handle: FlatParamHandle, out: torch.Tensor, full: torch.Tensor | FlatPieces
) -> comm.Pending:
    return comm.reduce_scatter_flat(out, full, handle.shard_group, where=handle.where)


def _all_reduce_into(
    handle: FlatParamHandle, out: torch.Tensor, full: torch.Tensor | FlatPieces
) -> comm.Pending:
    return comm.all_reduce_flat(out, handle.replicate_group, where=handle.where)


class _UnflattenViews(torch.autograd.Function):
    """The trainable parameters' views of a gathered flat parameter, as one autograd node.

    Differentiable only through ``anchor``: backward keeps the views' gradients on the handle
    (:meth:`FlatParamHandle.stash_view_grads`) and gives the anchor a zero. See [Note: gradients of a unit].
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, flat: torch.Tensor, handle: FlatParamHandle
    ) -> tuple[torch.Tensor, ...]:
        ctx.handle = handle
        ctx.set_materialize_grads(False)
        views = split_flat(flat, handle.layout)
        return tuple(views[i] for i in handle._trainable)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        handle = ctx.handle
        handle.stash_view_grads(grads)
        return torch.zeros_like(handle.grad_anchor), None, None


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


class HandleState(enum.Enum):
    SHARDED = "sharded"  # only the local shard exists; modules hold the original Parameters
    UNSHARDED = "unsharded"  # the flat parameter is gathered; modules hold views into it


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also for a gradient kept in a lower precision than the parameter.

    Autograd refuses a ``.grad`` of another dtype; a placeholder of the parameter's dtype (no memory:
    all strides zero) is assigned instead and its data swapped for the low-precision gradient.
    """
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    placeholder = torch.empty(1, dtype=param.dtype, device=grad.device).expand(grad.shape)
    param.grad = placeholder
    param.grad.data = grad


class FlatParamHandle:
    """One unit's parameters, flattened and sharded over ``shard_group`` (see the module notes).

    Args:
        params: the unit's parameters in flattening order (all one dtype).
        aliases: for each parameter, every ``(module, attribute)`` that holds it.
        names: a readable name per parameter, for error messages.
        shard_group: the ranks the flat parameter is sharded over (``None``: not distributed).
        replicate_group: ranks holding the same shard, whose gradients are all-reduced (or ``None``).
        device: where the shard lives and compute happens.
        sync_group: if given, the flat parameter is broadcast from this group's rank 0 before sharding.
        precision: the unit's dtypes (see [Note: mixed precision]); default: the parameters' own dtype.
        offload: keep the shard and the gradient shard in CPU memory (see [Note: CPU offload]).

    [Note: CPU offload]
    With ``offload`` the shard (pinned when compute is on CUDA) and the gradient shard live in CPU memory,
    and so do the parameters' views, so the optimizer steps on CPU. Each gather first copies the shard
    to the compute device (cast to the compute dtype in the same copy) on the pre-unshard stream, also
    with a shard group of one rank, where that copy is the whole gather: the compute stream waits for
    its event, never the CPU. The reduced gradient shard goes back without blocking either: averaged on
    the device, it is copied into a new pinned host buffer on the post-backward stream, right after its
    reduction, so no unit's backward waits for the copy (a blocking ``.to("cpu")`` there would stall the
    CPU in every unit's backward). The CPU reads those buffers only after waiting once, at the end of
    backward, for all the post-backward stream's work (``CommContext.sync_host``); there they are
    accumulated into the gradient shard (:meth:`accumulate_host_grads`), before the gradients are
    assigned and the optimizer reads them. On a CPU compute device the same path runs with CPU-to-CPU
    copies, which is what the CPU tests exercise; ``tests/fake_streams.py`` checks the CUDA
    ordering on CPU.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        aliases: Sequence[Sequence[Alias]],
        names: Sequence[str],
        shard_group: Any | None,
        replicate_group: Any | None,
        device: torch.device,
        sync_group: Any | None = None,
        precision: UnitPrecision | None = None,
        offload: bool = False,
    ) -> None:
        if not params:
            raise ValueError("FlatParamHandle needs at least one parameter.")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            listing = ", ".join(f"{n}: {p.dtype}" for n, p in zip(names, params, strict=False))
            raise ValueError(
                f"A unit's parameters must share one dtype to be flattened, found {listing}. HINT: wrap the "
                "modules of each dtype in their own unit (auto_wrap_policy) or cast the model first."
            )
        # Trainable parameters first (stable): their gradients are then a prefix of the flat parameter, and
        # each rank keeps gradient memory only for its part of that prefix (see [Note: frozen parameters]).
        order = sorted(range(len(params)), key=lambda i: not params[i].requires_grad)
        self.params: list[nn.Parameter] = [params[i] for i in order]
        self.aliases: list[list[Alias]] = [list(aliases[i]) for i in order]
        self.names: list[str] = [names[i] for i in order]
        params = self.params
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.device = device
        self.dtype: torch.dtype = next(iter(dtypes))
        self.precision = precision or UnitPrecision.resolve(None, self.dtype)
        if self.precision.param != self.dtype:
            raise ValueError(
                f"precision was resolved for {self.precision.param}, the parameters are {self.dtype}."
            )
        compute = self.precision.compute
        distributed = shard_group is not None and dist.is_available() and dist.is_initialized()
        self.shard_world = dist.get_world_size(shard_group) if distributed else 1
        self.shard_rank = dist.get_rank(shard_group) if distributed else 0
        self.replicate_world = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.layout = FlatLayout(tuple(p.shape for p in params), self.shard_world)
        self.shard_infos: tuple[ShardInfo, ...] = self.layout.shard_infos(self.shard_rank)
        lo, hi = self._range = (  # this rank's range of the flat parameter
            self.layout.shard_range(self.shard_rank)
            if self.shard_world > 1
            else (0, self.layout.padded_numel)
        )
        self._set_trainable([p.requires_grad for p in params])
        self.state = HandleState.SHARDED

        # Sharded over several CPU ranks, the full flat tensor is transient: a mapping of its own returns it
        # to the system when freed (heap memory would stay with the process; see [Note: materializing unit by unit]).
        transient = self.shard_world > 1 and device.type == "cpu"
        out = memory.empty_mapped((self.layout.padded_numel,), self.dtype) if transient else None
        full = flatten_tensors([p.detach().to(device) for p in params], self.layout, out=out)
        if sync_group is not None:
            dist.broadcast(full, src=dist.get_global_rank(sync_group, 0), group=sync_group)
        self.offload = offload
        self.shard_device = torch.device("cpu") if offload else device
        if offload:  # see [Note: CPU offload]
            pin = device.type == "cuda" and torch.cuda.is_available()
            self._sharded: torch.Tensor = torch.empty(hi - lo, dtype=self.dtype, pin_memory=pin)
            self._sharded.copy_(full[lo:hi])
            del full
        elif self.shard_world == 1:
            self._sharded = full  # 1-D, padded_numel == total_numel
        else:
            if device.type == "cpu":
                # The shard lives as long as the model: a mapping of its own (for large shards) keeps it
                # from pinning heap memory that the transient full tensors of later units would reuse.
                self._sharded = memory.empty_mapped((hi - lo,), self.dtype)
                self._sharded.copy_(full[lo:hi])
            else:
                self._sharded = full[lo:hi].clone()  # 1-D, shard_numel
            del full
        # Collectives write into _gather; _flat, the autograd leaf, shares its storage through ``.data``
        # but keeps a version counter of its own, so gathering again for backward does not invalidate
        # the views autograd saved in forward. See [Note: freeing gathered storage].
        # With one rank and no dtype change, the shard is the whole flat parameter and is used directly.
        self._gather_is_shard = self.shard_world == 1 and not self.precision.mixed and not offload
        if self._gather_is_shard:
            self._gather: torch.Tensor = self._sharded
        else:
            self._gather = torch.empty(self.layout.padded_numel, dtype=compute, device=device)
            memory.free_storage(self._gather)
        self._flat: torch.Tensor = torch.empty(0, dtype=compute, device=device)
        self._flat.data = self._gather
        # See [Note: gradients of a unit]: the unit's post-backward hook goes on this scalar leaf.
        self.grad_anchor = torch.zeros((), device=device, requires_grad=True)
        self._view_grads: list[torch.Tensor | None] | None = None  # this backward's, until post-backward
        # The gradient shard (1-D, like _sharded). Held strongly only during a backward pass; between
        # passes the parameters' .grad views keep it alive, so zero_grad(set_to_none=True) frees it.
        self._sharded_grad: torch.Tensor | None = None
        self._sharded_grad_ref: Callable[[], torch.Tensor | None] = lambda: None
        self._pending_unshard: _InFlight | None = None  # a gather issued and not yet waited for
        self._gather_label: watchdog.Label | None = None  # the last all-gather (CUDA): see the limiter
        # CPU offload: reduced gradient shards in host memory (1-D, the kept prefix), accumulated at the end
        # of backward once the CPU has waited for their copies (see [Note: CPU offload])
        self._host_grads: list[torch.Tensor] = []
        # (unit path, phase, step) of the next collectives, set by the runtime: see [Note: finding a desync]
        self.where: tuple[str, str, int] | None = None
        # no_sync: gradients stay unsharded and accumulate here, in the gradient dtype, until a backward
        # outside no_sync reduces them with its own (see [Note: no_sync]).
        self.sync_grads = True
        self._unsynced_grad: torch.Tensor | None = None
        self._grad_this_backward = False  # a reduced gradient was accumulated in this backward
        self._used: list[bool] = [False] * len(self.params)  # per param: gradient flowed into its view
        for p in self.params:
            _PARAM_TO_HANDLE[p] = self
        self.use_sharded_views()

    def _set_trainable(self, flags: list[bool]) -> None:
        """Record which parameters are trainable, and how much of this rank's gradient shard they need."""
        self.requires_grad: list[bool] = flags
        self._trainable: list[int] = [i for i, r in enumerate(flags) if r]
        self.any_requires_grad = any(flags)
        self.all_require_grad = all(flags)
        lo, hi = self._range
        end = max((self.layout.offsets[i] + self.layout.numels[i] for i in self._trainable), default=0)
        # Elements of this rank's gradient shard up to the last trainable parameter's (see [Note: frozen
        # parameters]): at shard() time a prefix holding exactly the trainable ones.
        self._grad_numel = hi - lo if self.all_require_grad else max(0, min(end, hi) - lo)

    def refresh_requires_grad(self, track_frozen: bool = False) -> None:
        """Follow ``requires_grad`` changed on the parameters since the last forward (freezing or unfreezing
        while training); call it before views are put on the modules for a forward (not a recomputation).

        ``track_frozen`` treats every parameter as trainable: their views record gradients, and
        :meth:`assign_grads` gives them only to parameters that require grad by then (for flags that may
        still change after the views are made).
        """
        flags = [True] * len(self.params) if track_frozen else [p.requires_grad for p in self.params]
        if flags != self.requires_grad:
            self._set_trainable(flags)

    def index_of(self, param: torch.Tensor) -> int:
        """Position of ``param`` (one of this unit's original parameters) in the flat parameter."""
        return next(i for i, q in enumerate(self.params) if q is param)

    # ------------------------------------------------------------------ views
    def _shard_piece(self, source: torch.Tensor, i: int) -> torch.Tensor:
        info = self.shard_infos[i]
        piece = source[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
        return piece.view(self.layout.shapes[i]) if self.shard_world == 1 else piece

    def piece(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece of the local shard: its data between steps, and also inside unshard_params."""
        return self._shard_piece(self._sharded, i)

    def use_sharded_views(self) -> None:
        """Point every original Parameter at its piece of the local shard and put it back on its modules."""
        for i, p in enumerate(self.params):
            p.data = self._shard_piece(self._sharded, i)
            for module, name in self.aliases[i]:
                module._parameters[name] = p

    def use_unsharded_views(self) -> None:
        """Put views of the gathered flat parameter on the modules (tracked by autograd if grad is on).

        Trainable views come from :class:`_UnflattenViews`, whose backward keeps their gradients for the
        post-backward hook and notes which parameters took part: a parameter no rank used keeps
        ``grad=None``, as it would without sharding (see :meth:`assign_grads`).
        """
        untracked = split_flat(self._flat.detach(), self.layout)
        views: list[torch.Tensor] = list(untracked)
        if torch.is_grad_enabled() and self.any_requires_grad:
            tracked = _UnflattenViews.apply(self.grad_anchor, self._flat, self)
            for i, view in zip(self._trainable, tracked, strict=True):
                views[i] = view
        for i, view in enumerate(views):
            for module, name in self.aliases[i]:
                module._parameters[name] = view  # type: ignore[assignment]

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

    def pack_grads(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One padded flat gradient from the trainable views' gradients (``None``: not used, zeros).

        The buffer is allocated here (on the compute stream) rather than by autograd, so large CPU
        buffers get huge pages (see [Note: huge pages for CPU buffers]).
        """
        flat = memory.empty_flat(self.layout.padded_numel, self._flat.dtype, self.device)
        pieces = split_flat(flat, self.layout)
        written = [False] * len(self.params)
        for i, grad in zip(self._trainable, grads, strict=True):
            if grad is not None:
                pieces[i].copy_(grad)
                written[i] = True
        for i, done in enumerate(written):
            if not done:
                pieces[i].zero_()
        flat[self.layout.total_numel :].zero_()
        return flat

    def gradient_to_reduce(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | FlatPieces:
        """What :meth:`reduce_grad` reduces: these gradients plus what ``no_sync`` kept.

        Left in autograd's per-parameter tensors (:class:`FlatPieces`) for a reduce-scatter on the
        shared-memory transport that needs no cast and no scaling of them first; packed into one flat
        buffer otherwise.
        """
        reduce_dtype = self.precision.reduce
        pre, _ = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if (
            self.shard_world > 1
            and self.device.type == "cpu"
            and not self.has_unsynced
            and pre == 1.0
            and reduce_dtype == self._flat.dtype
            and comm.reads_pieces(self.shard_group)
        ):
            offsets = self.layout.offsets
            return FlatPieces(
                self.layout.padded_numel,
                reduce_dtype,
                self.device,
                [(offsets[i], g) for i, g in zip(self._trainable, grads, strict=True) if g is not None],
            )
        flat = self.with_unsynced(self.pack_grads(grads))
        assert flat is not None
        return flat

    # ------------------------------------------------------------------ gather / free
    def unshard(self, streams: CommContext | None = None, limiter: AllGatherLimiter | None = None) -> None:
        """Start gathering the flat parameter (asynchronously); :meth:`wait_unshard` makes it usable.

        See [Note: stream overlap] for which stream allocates and which waits.
        """
        if self.state is HandleState.UNSHARDED:
            return
        self.state = HandleState.UNSHARDED
        if self._gather_is_shard:
            return
        if limiter is not None and self.shard_world > 1:
            limiter.before_all_gather()  # see [Note: rate limiter]
        memory.alloc_storage(self._gather)  # on the compute stream
        cuda = streams is not None and streams.is_cuda
        if self.shard_world == 1:  # one rank, mixed precision or offload: the copy is the whole "gather"
            if not cuda:
                self._gather.copy_(self._sharded)
                return
            assert streams is not None
            streams.side_waits_compute(streams.pre_unshard)
            with streams.on(streams.pre_unshard):  # pinned host memory with offload: see [Note: CPU offload]
                self._gather.copy_(self._sharded, non_blocking=True)
            event = streams.record(streams.pre_unshard)
            self._pending_unshard = _InFlight(comm.Pending(self._gather, None), event, None)
            return
        source = self._sharded
        cast_done = None
        if self.precision.mixed or self.offload:
            # all-gather a copy of the shard on the compute device, in the compute dtype, made on pre_unshard
            source = memory.empty_flat(self._sharded.numel(), self._gather.dtype, self.device)
            if cuda:
                assert streams is not None
                streams.side_waits_compute(streams.pre_unshard)
                with streams.on(streams.pre_unshard):
                    source.copy_(self._sharded, non_blocking=True)  # pinned host memory with offload
                cast_done = streams.record(streams.pre_unshard)
            else:
                source.copy_(self._sharded)
        if cuda:
            assert streams is not None
            streams.side_waits_compute(streams.unshard)
            streams.wait(cast_done, streams.unshard)
            with streams.on(streams.unshard):
                pending = comm.all_gather_flat(self._gather, source, self.shard_group, where=self.where)
                pending.wait()  # the unshard stream (not the CPU) waits for the collective
                self._pending_unshard = _InFlight(pending, streams.record(streams.unshard), source)
                self._gather_label = pending.label  # what the limiter's wait on this buffer waits for
        else:
            pending = comm.all_gather_flat(self._gather, source, self.shard_group, where=self.where)
            self._pending_unshard = _InFlight(pending, None, source)

    def wait_unshard(self, streams: CommContext | None = None) -> None:
        """Block the compute stream (CUDA) or the CPU (gloo) until the gather has landed."""
        inflight, self._pending_unshard = self._pending_unshard, None
        if inflight is None:
            return
        if inflight.event is not None and streams is not None:
            streams.wait(inflight.event)
        else:
            inflight.pending.wait()

    def reshard(self, streams: CommContext | None = None, limiter: AllGatherLimiter | None = None) -> None:
        """Free the gathered flat parameter and restore the original Parameters on the modules."""
        if self.state is HandleState.SHARDED:
            return
        self.wait_unshard(streams)  # never free a buffer a collective may still write (unused prefetch)
        self.use_sharded_views()
        if not self._gather_is_shard:
            memory.free_storage(self._gather)
            if limiter is not None and streams is not None and self.shard_world > 1:
                limiter.record_free(streams.record, self._gather_label)
        self.state = HandleState.SHARDED

    # ------------------------------------------------------------------ gradients
    def keep_unsynced(self, flat_grad: torch.Tensor) -> None:
        """Inside ``no_sync``: add an unsharded flat gradient to the ones kept since the last reduction."""
        if self._unsynced_grad is None:
            self._unsynced_grad = flat_grad.to(self.precision.grad)  # a buffer of our own: no copy needed
        else:
            self._unsynced_grad.add_(flat_grad)

    def with_unsynced(self, flat_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient to reduce now: ``flat_grad`` plus whatever ``no_sync`` kept (both may be missing)."""
        kept, self._unsynced_grad = self._unsynced_grad, None
        if kept is None:
            return flat_grad
        if flat_grad is not None:
            kept.add_(flat_grad)
        return kept

    @property
    def has_unsynced(self) -> bool:
        return self._unsynced_grad is not None

    def reduce_grad(
        self, flat_grad: torch.Tensor | FlatPieces, streams: CommContext | None = None
    ) -> _InFlight:
        """Start reducing an unsharded flat gradient to this rank's gradient shard (a SUM; see finish_grad).

        ``flat_grad`` is kept alive in the returned record until :meth:`finish_grad` has waited. Under
        mixed precision it is cast to the reduce dtype first, and part of the average is taken before
        the reduction in 16-bit dtypes (:func:`~flatshard.engine.precision.reduce_divisors`). Given as
        :class:`FlatPieces` (see :meth:`gradient_to_reduce`) it needs neither and is reduce-scattered.
        """
        if isinstance(flat_grad, FlatPieces):
            out = memory.empty_flat(self._sharded.numel(), flat_grad.dtype, self.device)
            return _InFlight(_reduce_scatter_into(self, out, flat_grad), None, flat_grad)
        reduce_dtype = self.precision.reduce
        if flat_grad.dtype != reduce_dtype:
            flat_grad = flat_grad.to(reduce_dtype)
        pre, _ = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if pre != 1.0:
            flat_grad.div_(pre)
        collective: Callable[[FlatParamHandle, torch.Tensor, torch.Tensor], comm.Pending] | None
        if self.shard_world == 1:
            out, collective = flat_grad, _all_reduce_into if self.replicate_world > 1 else None
        else:
            out = memory.empty_flat(self._sharded.numel(), reduce_dtype, self.device)  # on compute
            collective = _reduce_scatter_into
        if streams is None or not streams.is_cuda:
            pending = collective(self, out, flat_grad) if collective is not None else comm.Pending(out, None)
            return _InFlight(pending, None, flat_grad)
        if collective is None and not self.offload:
            return _InFlight(comm.Pending(out, None), None, flat_grad)
        # See [Note: stream overlap]: everything below is queued on the post-backward stream, after the
        # compute stream's work so far; the compute stream waits for its event in finish_grad.
        scratch = self._cast_scratch(out.dtype) if self.offload else None  # allocated on compute
        streams.side_waits_compute(streams.post_backward)
        with streams.on(streams.post_backward):
            pending = comm.Pending(out, None)
            if collective is not None:
                pending = collective(self, out, flat_grad)
                pending.wait()  # the post-backward stream (not the CPU) waits for the collective
            if self.shard_world > 1 and self.replicate_world > 1:  # hybrid sharding: across shard groups
                comm.all_reduce_flat(out, self.replicate_group, where=self.where).wait()
            host = self._copy_to_host(out, scratch, streams) if self.offload else None
            event = streams.record(streams.post_backward)
        keepalive = flat_grad if scratch is None else (flat_grad, scratch)
        return _InFlight(pending, event, keepalive, host)

    def finish_grad(self, inflight: _InFlight, streams: CommContext | None = None) -> None:
        """Wait for a reduction, average it and accumulate it into the parameters' gradients.

        With CPU offload the gradient shard is copied to host memory instead and accumulated by
        :meth:`accumulate_host_grads` once the CPU has waited for the copies (see [Note: CPU offload]).
        """
        if inflight.event is not None and streams is not None:
            streams.wait(inflight.event)  # the compute stream: the reduction (and any copy to host) is done
            grad = inflight.pending.output
        else:
            grad = inflight.pending.wait()
            if self.shard_world > 1 and self.replicate_world > 1:  # on CUDA: issued by reduce_grad
                comm.all_reduce_flat(grad, self.replicate_group, async_op=False, where=self.where)
        if self.offload:
            host = inflight.host if inflight.host is not None else self._copy_to_host(grad, None, streams)
            self._host_grads.append(host)
            return
        _, post = reduce_divisors(self.shard_world * self.replicate_world, grad.dtype)
        if grad.dtype != self.precision.grad:
            grad = grad.to(self.precision.grad)
        if post != 1.0:
            grad.div_(post)
        self._accumulate(grad)

    def _cast_scratch(self, reduce_dtype: torch.dtype) -> torch.Tensor | None:
        """A device buffer for casting a reduced shard to the gradient dtype before it is averaged (the
        order finish_grad uses without offload), or ``None`` when the copy to host can cast by itself."""
        _, post = reduce_divisors(self.shard_world * self.replicate_world, reduce_dtype)
        if post == 1.0 or reduce_dtype == self.precision.grad:
            return None
        return memory.empty_flat(self._grad_numel, self.precision.grad, self.device)

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
                _set_grad(p, view)
        self.reset_backward()

    def reset_backward(self) -> None:
        if self._sharded_grad is not None:
            self._sharded_grad_ref = _weak_flat(self._sharded_grad)
            self._sharded_grad = None
        self._grad_this_backward = False
        self._used = [False] * len(self.params)

    # ------------------------------------------------------------------ inspection
    @property
    def sharded(self) -> torch.Tensor:
        """The local shard (1-D, padded at the end on the last rank(s))."""
        return self._sharded

    @property
    def flat(self) -> torch.Tensor:
        """The gathered flat parameter (storage is empty while SHARDED on a multi-rank group)."""
        return self._flat

    def __repr__(self) -> str:
        return (
            f"FlatParamHandle(params={len(self.params)}, numel={self.layout.total_numel}, "
            f"shard={self.layout.shard_numel}x{self.shard_world}, state={self.state.value})"
        )
