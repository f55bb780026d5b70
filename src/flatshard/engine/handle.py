"""FlatParamHandle: one unit's flat parameter, its storage states and parameter views: the gather path.

The gradient path (reduction to the gradient shard, ``no_sync``, offloaded gradients) is
:class:`~flatshard.engine.gradients.UnitGradients`, which the handle inherits; see [Note: gradients of a unit]
there.

[Note: original parameters as views]
The unit keeps the user's own ``nn.Parameter`` objects (so optimizers built before or after
``shard()`` and per-name param groups keep working). Their ``.data`` is swapped, never the objects:

- SHARDED: each parameter's data is its piece of the local shard, a view into ``_sharded``. With a
  shard group of one rank (NO_SHARD, or a single process) the piece is the whole parameter and keeps
  its shape; otherwise it is 1-D, possibly empty, the same rule on every rank so param groups agree.
  Gradients are views into the local gradient shard, laid out the same way.
- UNSHARDED (inside a unit's forward and backward): the module attributes are replaced by plain tensor
  views of ``_flat``, the gathered flat parameter. The trainable views come out of one autograd node,
  :class:`_UnflattenViews` (see [Note: gradients of a unit]).

[Note: freeing gathered storage]
``_flat`` is allocated once and only its storage is resized: to zero when resharded, back to full when
gathered. Autograd saves views of ``_flat`` in forward; FULL_SHARD frees the storage after forward and
gathers into the same storage again before backward, so the saved views see the right values.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.function import once_differentiable

from flatshard.engine.flat_param import FlatLayout, ShardInfo, flatten_tensors, split_flat
from flatshard.engine.float8 import Float8Weights, refresh_scales
from flatshard.engine.gradients import UnitGradients
from flatshard.engine.precision import UnitPrecision
from flatshard.engine.setup.wrap import Alias
from flatshard.engine.step.host_shard import HostShard
from flatshard.engine.tensor_parallel import TensorParallelLayout
from flatshard.engine.transport.comm import InFlight, Pending, as_wire
from flatshard.engine.transport.interface import Transport
from flatshard.engine.transport.limiter import AllGatherLimiter
from flatshard.engine.transport.streams import CommContext
from flatshard.engine.transport.watchdog import Label
from flatshard.engine.unfilled import fill_marker

__all__ = ["FlatParamHandle", "HandleState", "handle_of_param", "locate_params"]

# A managed Parameter's link to its handle, in the parameter's own __dict__, so it goes with the parameter; a
# copy of the parameter (deepcopy makes none, copy and swap_tensors carry it over) is not at that index and is
# no unit's.
_HANDLE_ATTR = "_flatshard_handle"


class _HandleLink:
    """A weak reference to a parameter's handle and the parameter's index there. Pickled (``torch.save`` of a
    live parameter or module) it becomes an empty ``set``: the saved parameter is its piece, no unit's, and
    loads with ``weights_only=True``."""

    __slots__ = ("index", "ref")

    def __init__(self, handle: FlatParamHandle, index: int) -> None:
        self.ref = weakref.ref(handle)
        self.index = index

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return set, ()


def handle_of_param(param: torch.Tensor) -> FlatParamHandle | None:
    """The handle managing ``param``, or ``None`` for a parameter flatshard does not manage."""
    link = param.__dict__.get(_HANDLE_ATTR)
    if not isinstance(link, _HandleLink):
        return None
    handle: FlatParamHandle | None = link.ref()
    if handle is None or link.index >= len(handle.params) or handle.params[link.index] is not param:
        return None
    return handle


def locate_params(params: list[torch.Tensor]) -> list[tuple[FlatParamHandle | None, int]]:
    """Each parameter's handle (``None`` when it is no unit's) and its index in that handle."""
    out: list[tuple[FlatParamHandle | None, int]] = []
    for p in params:
        handle = handle_of_param(p)
        out.append((handle, -1 if handle is None else handle.index_of(p)))
    return out


class _UnflattenViews(torch.autograd.Function):
    """The trainable parameters' views of a gathered flat parameter, as one autograd node.

    Differentiable only through ``anchor``: backward keeps the views' gradients on the handle
    (:meth:`FlatParamHandle.stash_view_grads`) and gives the anchor a zero. See [Note: gradients of a unit].
    The node holds the handle weakly: a view left on a module (the root stays gathered after a forward that
    no backward followed) keeps the node, and a strong reference from it would make a cycle through autograd's
    graph that the garbage collector cannot see, keeping the model alive after its last reference is dropped.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, flat: torch.Tensor, handle: FlatParamHandle
    ) -> tuple[torch.Tensor, ...]:
        ctx.handle = weakref.ref(handle)
        ctx.set_materialize_grads(False)
        views = split_flat(flat, handle.layout)
        if handle.float8 is not None:  # see [Note: float8 all-gathers]
            return tuple(
                handle.float8.wrap(
                    [views[i] for i in handle._trainable], handle._trainable, handle.precision.compute
                )
            )
        return tuple(views[i] for i in handle._trainable)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        handle = ctx.handle()
        if handle is None:  # the model is gone: nothing to give gradients to
            return None, None, None
        handle.stash_view_grads(grads)
        return torch.zeros_like(handle.grad_anchor), None, None


class HandleState(enum.Enum):
    SHARDED = "sharded"  # only the local shard exists; modules hold the original Parameters
    UNSHARDED = "unsharded"  # the flat parameter is gathered; modules hold views into it


class FlatParamHandle(UnitGradients):
    """One unit's parameters, flattened and sharded over ``shard_group`` (see the module notes).

    Args:
        params: the unit's parameters in flattening order (all one dtype).
        aliases: for each parameter, every ``(module, attribute)`` that holds it.
        names: a readable name per parameter, for error messages.
        shard_group: the ranks the flat parameter is sharded over (``None``: not distributed).
        replicate_group: ranks holding the same shard, whose gradients are all-reduced (or ``None``).
        device: where the shard lives and compute happens.
        sync_group: if given, the flat parameter is broadcast from this group's rank 0 before sharding.
        transport: how its collectives run and its buffers are allocated (see [Note: the transport interface]);
            default: one of its own for these groups and device.
        precision: the unit's dtypes (see [Note: mixed precision]); default: the parameters' own dtype.
        offload: keep the shard and the gradient shard in CPU memory (see [Note: CPU offload]).
        float8: the parameters are torchao ``Float8Linear`` weights gathered in float8 (see [Note: float8
            all-gathers]); the shard keeps their dtype.
        offload_optimizer: the optimizer steps on host copies of the shard and the gradient shard, kept in
            :attr:`host` (see [Note: optimizer offload]); the shards stay on ``device``. Not with ``offload``.
        unfilled: ``id()`` of parameters nothing gave values (see [Note: unfilled tensors]); a parameter on
            the meta device is one too, and keeps no full storage: the shard is built from pieces.

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
        unfilled: Collection[int] = (),
        transport: Transport | None = None,
        offload_optimizer: bool = False,
        float8: Float8Weights | None = None,
        tensor_parallel: Sequence[TensorParallelLayout | None] = (),
    ) -> None:
        if not params:
            raise ValueError("FlatParamHandle needs at least one parameter.")
        if offload and offload_optimizer:
            raise ValueError(
                "offload (shards in CPU memory) already steps the optimizer there. HINT: pass one of offload, "
                "offload_optimizer."
            )
        if offload and float8 is not None:
            raise ValueError(
                "float8 all-gathers cast the shard on the compute device; cpu_offload=True keeps it on the host. "
                "HINT: use cpu_offload='optimizer' (the shard stays on the device), or convert the model with "
                "Float8LinearConfig(enable_fsdp_float8_all_gather=False)."
            )
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            listing = ", ".join(f"{n}: {p.dtype}" for n, p in zip(names, params, strict=False))
            raise ValueError(
                f"A flat parameter holds one dtype, found {listing}. HINT: give each dtype a handle of its own, "
                "as shard() does (see [Note: a unit of several dtypes])."
            )
        # Trainable parameters first (stable): their gradients are then a prefix of the flat parameter, and
        # each rank keeps gradient memory only for its part of that prefix (see [Note: frozen parameters]).
        order = sorted(range(len(params)), key=lambda i: not params[i].requires_grad)
        self.params: list[nn.Parameter] = [params[i] for i in order]
        self.aliases: list[list[Alias]] = [list(aliases[i]) for i in order]
        self.names: list[str] = [names[i] for i in order]
        # see [Note: tensor parallelism]; None when no parameter is a tensor-parallel one
        self.tensor_parallel: list[TensorParallelLayout | None] | None = (
            [tensor_parallel[i] for i in order] if any(t is not None for t in tensor_parallel) else None
        )
        if self.tensor_parallel is not None and float8 is not None:
            raise ValueError(
                "float8 all-gathers of tensor-parallel weights are not supported. HINT: convert with "
                "Float8LinearConfig(enable_fsdp_float8_all_gather=False), or use torchao's float8 tensor-parallel "
                "styles without flatshard's float8 gather."
            )
        params = self.params
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.device = device
        if transport is None or not transport.serves(shard_group, replicate_group, device):
            transport = Transport(shard_group, replicate_group, device)
        self.transport = transport
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

        # Parameters nothing gave values: see [Note: unfilled tensors]
        # A meta device is a dry run (see [Note: sharding on the meta device]): nothing is ever filled or refused.
        dry_run = device.type == "meta"
        self.unfilled: set[int] = (
            set() if dry_run else {i for i, p in enumerate(params) if p.is_meta or id(p) in unfilled}
        )
        self.offload = offload
        self.shard_device = torch.device("cpu") if offload else device
        # host copies for an optimizer stepping in CPU memory, allocated at its first use
        self.host: HostShard | None = HostShard(device) if offload_optimizer else None
        if not dry_run and any(p.is_meta for p in params):
            if sync_group is not None:
                raise ValueError(
                    "sync_module_states needs every parameter materialized before it is sharded."
                )
            self._sharded: torch.Tensor = self._shard_from_pieces(params, lo, hi)
            for i, p in enumerate(params):
                if p.is_meta:  # its data becomes a piece of the shard: a Parameter that can hold one
                    self._replace_param(i, nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad))
        else:
            self._sharded = self._shard_from_full(params, lo, hi, sync_group)
        # Collectives write into _gather; _flat, the autograd leaf, shares its storage through ``.data``
        # but keeps a version counter of its own, so gathering again for backward does not invalidate
        # the views autograd saved in forward. See [Note: freeing gathered storage].
        # With one rank and no dtype change, the shard is the whole flat parameter and is used directly.
        self.float8 = float8
        gathered = float8.dtype if float8 is not None else compute  # the gathered flat parameter's dtype
        self._gather_is_shard = (
            self.shard_world == 1 and not self.precision.mixed and not offload and not float8
        )
        if self._gather_is_shard:
            self._gather: torch.Tensor = self._sharded
        else:
            self._gather = torch.empty(self.layout.padded_numel, dtype=gathered, device=device)
            self.transport.free_gathered(self._gather)
        self._flat: torch.Tensor = torch.empty(0, dtype=gathered, device=device)
        self._flat.data = self._gather
        # Views made once and reused every step: the shard's pieces, and the gathered flat's untracked views
        # (valid across frees and gathers, which keep the storage object).
        self._piece_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._flat_views: list[torch.Tensor] | None = None
        # See [Note: gradients of a unit]: the unit's post-backward hook goes on this scalar leaf.
        self.grad_anchor = torch.zeros((), device=device, requires_grad=True)
        self._pending_unshard: InFlight | None = None  # a gather issued and not yet waited for
        # reshard_after_forward=k: this rank's 1/k of the gathered flat parameter and the group of k it is
        # gathered over in backward (see [Note: a node-local copy for backward])
        self._local: tuple[torch.Tensor, Any] | None = None
        self._gather_label: Label | None = None  # the last all-gather (CUDA): see the limiter
        # (unit path, phase, step) of the next collectives, set by the runtime: see [Note: finding a desync]
        self.where: tuple[str, str, int] | None = None
        self._init_gradients()
        for i, p in enumerate(self.params):
            p.__dict__[_HANDLE_ATTR] = _HandleLink(self, i)
        self.use_sharded_views()

    def _replace_param(self, i: int, param: nn.Parameter) -> None:
        self.params[i] = param
        param.__dict__[_HANDLE_ATTR] = _HandleLink(self, i)
        for module, name in self.aliases[i]:
            module._parameters[name] = param

    def mark_filled(self, i: int) -> None:
        """Parameter ``i`` was given values (see [Note: unfilled tensors])."""
        self.unfilled.discard(i)

    def unfilled_names(self) -> list[str]:
        return [self.names[i] for i in sorted(self.unfilled)]

    def _new_shard(self, n: int) -> torch.Tensor:
        """Uninitialized storage for this rank's shard of ``n`` elements, where the shard lives."""
        if self.offload:  # see [Note: CPU offload]
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            return torch.empty(n, dtype=self.dtype, pin_memory=pin)
        return self.transport.empty_shard(n, self.dtype)

    def _shard_from_pieces(self, params: Sequence[nn.Parameter], lo: int, hi: int) -> torch.Tensor:
        """This rank's shard written piece by piece: the marker for parameters on the meta device (no full
        tensor of theirs ever exists), their pieces for the others, zeros for the padding."""
        shard = self._new_shard(hi - lo)
        for p, info in zip(params, self.shard_infos, strict=True):
            if not info.numel_in_shard:
                continue
            piece = shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            if p.is_meta:
                fill_marker(piece)
            else:
                flat = p.detach().reshape(-1)
                piece.copy_(flat[info.offset_in_param : info.offset_in_param + info.numel_in_shard])
        valid = self.layout.valid_numel(self.shard_rank) if self.shard_world > 1 else self.layout.total_numel
        if valid < hi - lo:
            shard[valid:].zero_()
        return shard

    def _shard_from_full(
        self, params: Sequence[nn.Parameter], lo: int, hi: int, sync_group: Any | None
    ) -> torch.Tensor:
        """This rank's shard cut from the unit's whole flat parameter (broadcast from rank 0 of
        ``sync_group`` first, if given)."""
        # The full flat tensor is transient: memory the transport returns to the system when freed.
        out = self.transport.empty_transient(self.layout.padded_numel, self.dtype)
        full = flatten_tensors([p.detach().to(self.device) for p in params], self.layout, out=out)
        if sync_group is not None:
            dist.broadcast(as_wire(full), src=dist.get_global_rank(sync_group, 0), group=sync_group)
        if self.shard_world == 1 and not self.offload:
            return full  # 1-D, padded_numel == total_numel
        if self.offload or self.device.type == "cpu":
            sharded = self._new_shard(hi - lo)
            sharded.copy_(full[lo:hi])
            return sharded
        return full[lo:hi].clone()  # 1-D, shard_numel

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
        # What a reduction moves per rank: the start of each shard up to the trainable extent (see [Note:
        # reducing only what trains]); the whole shard when everything trains.
        self._shard_len = hi - lo
        # Trainable parameters first, in order (as shard() lays them out until requires_grad changes):
        # their gradients then pack with one concatenation (see pack_grads).
        self._trainable_is_prefix = self._trainable == list(range(len(self._trainable)))
        self._trainable_end = end
        self._reduce_chunk = self._shard_len if self.all_require_grad else min(self._shard_len, end)

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

    def tensor_parallel_of(self, positions: Iterable[int]) -> dict[int, TensorParallelLayout]:
        """The layouts of the tensor-parallel parameters among ``positions`` (see [Note: tensor parallelism])."""
        layouts = self.tensor_parallel
        return {} if layouts is None else {i: t for i in positions if (t := layouts[i]) is not None}

    def full_shape(self, i: int) -> torch.Size:
        """Parameter ``i``'s shape in a full state dict: the whole tensor's, for a tensor-parallel piece."""
        layout = self.tensor_parallel[i] if self.tensor_parallel is not None else None
        return layout.shape if layout is not None else self.layout.shapes[i]

    def local_of_full(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``i``'s full-state value (or of state shaped like it)."""
        layout = self.tensor_parallel[i] if self.tensor_parallel is not None else None
        return layout.local_part(value) if layout is not None else value

    def index_of(self, param: torch.Tensor) -> int:
        """Position of ``param`` (one of this unit's original parameters) in the flat parameter."""
        return next(i for i, q in enumerate(self.params) if q is param)

    # ------------------------------------------------------------------ views
    def _shard_piece(self, source: torch.Tensor, i: int) -> torch.Tensor:
        info = self.shard_infos[i]
        piece = source[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
        return piece.view(self.layout.shapes[i]) if self.shard_world == 1 else piece

    def piece_of(self, source: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece of ``source``, a 1-D tensor laid out like the local shard (at least up to the
        piece's end): shaped as :meth:`piece` is."""
        return self._shard_piece(source, i)

    def piece(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece of the local shard: its data between steps, and also inside unshard_params."""
        return self._shard_piece(self._sharded, i)

    def use_sharded_views(self) -> None:
        """Point every original Parameter at its piece of the local shard and put it back on its modules.

        The pieces are views made once per shard tensor (the shard is never reallocated, and setting
        ``.data`` copies a view's metadata, never shares the view): this runs twice per unit per step.
        """
        cached = self._piece_views
        if cached is None or cached[0] is not self._sharded:
            cached = self._piece_views = (
                self._sharded,
                [self._shard_piece(self._sharded, i) for i in range(len(self.params))],
            )
        for p, piece, aliases in zip(self.params, cached[1], self.aliases, strict=True):
            p.data = piece
            for module, name in aliases:
                module._parameters[name] = p

    def use_unsharded_views(self) -> None:
        """Put views of the gathered flat parameter on the modules (tracked by autograd if grad is on).

        Trainable views come from :class:`_UnflattenViews`, whose backward keeps their gradients for the
        post-backward hook and notes which parameters took part: a parameter no rank used keeps
        ``grad=None``, as it would without sharding (see :meth:`assign_grads`).
        """
        cached = self._flat_views
        if (
            cached is None
        ):  # _flat's storage object lives as long as the unit: [Note: freeing gathered storage]
            cached = self._flat_views = split_flat(self._flat.detach(), self.layout)
        views: list[torch.Tensor] = list(cached)
        untracked: Sequence[int] = range(len(views))
        if torch.is_grad_enabled() and self.any_requires_grad:
            tracked = _UnflattenViews.apply(self.grad_anchor, self._flat, self)
            for i, view in zip(self._trainable, tracked, strict=True):
                views[i] = view
            untracked = [i for i, r in enumerate(self.requires_grad) if not r]
        if self.float8 is not None and untracked:  # tracked ones come wrapped: see [Note: float8 all-gathers]
            wrapped = self.float8.wrap([views[i] for i in untracked], untracked, self.precision.compute)
            for i, view in zip(untracked, wrapped, strict=True):
                views[i] = view
        layouts = self.tensor_parallel
        for i, view in enumerate(views):
            if layouts is not None and layouts[i] is not None:  # see [Note: tensor parallelism]
                view = layouts[i].wrap(view)  # type: ignore[union-attr]
            for module, name in self.aliases[i]:
                module._parameters[name] = view  # type: ignore[assignment]

    # ------------------------------------------------------------------ gather / free
    def unshard(
        self,
        streams: CommContext | None = None,
        limiter: AllGatherLimiter | None = None,
        from_local: bool = False,
    ) -> None:
        """Start gathering the flat parameter (asynchronously); :meth:`wait_unshard` makes it usable.

        ``from_local`` (in backward): gather from the node-local copy forward kept, if there is one.
        See [Note: stream overlap] for which stream allocates and which waits.
        """
        if self.state is HandleState.UNSHARDED:
            return
        self.state = HandleState.UNSHARDED
        if self._gather_is_shard:
            return
        if limiter is not None and self.shard_world > 1:
            limiter.before_all_gather()  # see [Note: rate limiter]
        self.transport.alloc_gathered(self._gather)  # on the compute stream
        cuda = streams is not None and streams.is_cuda
        local, self._local = self._local, None
        if local is not None and from_local:  # see [Note: a node-local copy for backward]
            self._gather_over(local[0], local[1], streams, None)
            return
        if self.shard_world == 1:  # one rank, mixed precision or offload: the copy is the whole "gather"
            if not cuda:
                self._cast_shard_into(self._gather)
                return
            assert streams is not None
            streams.side_waits_compute(streams.pre_unshard)
            with streams.on(streams.pre_unshard):  # pinned host memory with offload: see [Note: CPU offload]
                self._cast_shard_into(self._gather)
            event = streams.record(streams.pre_unshard)
            self._pending_unshard = InFlight(Pending(self._gather, None), event, None)
            return
        source = self._sharded
        cast_done = None
        if self.precision.mixed or self.offload or self.float8 is not None:
            # all-gather a copy of the shard on the compute device, in the gathered dtype, made on pre_unshard
            source = self.transport.empty_flat(self._sharded.numel(), self._gather.dtype)
            if cuda:
                assert streams is not None
                streams.side_waits_compute(streams.pre_unshard)
                with streams.on(streams.pre_unshard):
                    self._cast_shard_into(source)  # pinned host memory with offload
                cast_done = streams.record(streams.pre_unshard)
            else:
                self._cast_shard_into(source)
        self._gather_over(source, self.shard_group, streams, cast_done)

    def _gather_over(self, source: torch.Tensor, group: Any, streams: CommContext | None, after: Any) -> None:
        """All-gather ``source`` over ``group`` into the gathered flat parameter, after the event ``after``."""
        if streams is not None and streams.is_cuda:
            streams.side_waits_compute(streams.unshard)
            streams.wait(after, streams.unshard)
            with streams.on(streams.unshard):
                pending = self.transport.all_gather(self._gather, source, self.where, group=group)
                pending.wait()  # the unshard stream (not the CPU) waits for the collective
                self._pending_unshard = InFlight(pending, streams.record(streams.unshard), source)
                self._gather_label = pending.label  # what the limiter's wait on this buffer waits for
        else:
            pending = self.transport.all_gather(self._gather, source, self.where, group=group)
            self._pending_unshard = InFlight(pending, None, source)

    def _cast_shard_into(self, out: torch.Tensor) -> None:
        """The local shard in ``out``'s dtype (float8 weights with their scales), on the current stream."""
        if self.float8 is None:
            out.copy_(self._sharded, non_blocking=True)
            return
        if self.float8.scales is None:  # gathered before any root forward computed them
            refresh_scales([self], 0)
        self.float8.cast_into(out, self._sharded, self.shard_infos)

    def wait_unshard(self, streams: CommContext | None = None) -> None:
        """Block the compute stream (CUDA) or the CPU (gloo) until the gather has landed."""
        inflight, self._pending_unshard = self._pending_unshard, None
        if inflight is None:
            return
        if inflight.event is not None and streams is not None:
            streams.wait(inflight.event)
        else:
            inflight.pending.wait()

    def reshard(
        self,
        streams: CommContext | None = None,
        limiter: AllGatherLimiter | None = None,
        keep_local: Any = None,
    ) -> None:
        """Free the gathered flat parameter and restore the original Parameters on the modules.

        ``keep_local`` (a group of ``k`` ranks of the shard group, after a training forward): first keep this
        rank's ``1/k`` of the gathered flat parameter, for backward to gather over that group alone.

        [Note: a node-local copy for backward]
        Under FULL_SHARD over several nodes a unit is gathered from every rank twice per step. With
        ``reshard_after_forward=k`` (ranks per node) forward keeps, instead of nothing, the ``1/k`` slice of the
        gathered flat parameter that this rank's position in its group of ``k`` consecutive ranks names (FSDP2's
        ``reshard_after_forward=<int>``, ZeRO++'s hpZ): backward all-gathers those slices over the group of
        ``k``, inside the node, and frees the copy. The copy is in the gathered dtype (the compute or float8
        dtype), so backward needs no cast. A copy no backward used is dropped at the root's next training
        forward and at the end of a backward.
        """
        if self.state is HandleState.SHARDED:
            return
        self.wait_unshard(streams)  # never free a buffer a collective may still write (unused prefetch)
        if keep_local is not None and not self._gather_is_shard:
            k = dist.get_world_size(keep_local)
            n = self.layout.padded_numel // k
            at = self.shard_rank % k * n
            self._local = (self._gather[at : at + n].clone(), keep_local)
        self.use_sharded_views()
        if not self._gather_is_shard:
            self.transport.free_gathered(self._gather)
            if limiter is not None and streams is not None and self.shard_world > 1:
                limiter.record_free(streams.record, self._gather_label)
        self.state = HandleState.SHARDED

    def drop_local(self) -> None:
        """Free a node-local copy forward kept that no backward used (see [Note: a node-local copy for backward])."""
        self._local = None

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
