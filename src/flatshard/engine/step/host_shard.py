"""A unit's host copies for an optimizer that steps in CPU memory while the unit's shards stay on the device
(``cpu_offload="optimizer"``): see [Note: optimizer offload] in ``flatshard.engine.step.optimizer_offload``.

[Note: host copies and the streams]
On CUDA every copy between a unit's device shards and its pinned host buffers runs on a side stream of the root
(see [Note: stream overlap]) and never blocks the CPU where it is issued:

- gradient shard -> host, on ``post_backward``: issued in backward as soon as a unit's reduced gradient is in its
  gradient shard (:meth:`HostShard.copy_grad`), so it overlaps the backward of the units before it. The compute
  stream waits for it before it writes that gradient shard again (a second reduction in the same backward), and
  once at the end of backward, so clipping and the next micro-batch's accumulation come after it.
- shard -> host, on ``post_backward``: before a step, only where the device shard was written since the last
  one (a load, ``unshard_params`` with writeback, an EMA swap, an in-place edit through a parameter): between
  steps the host copy equals the shard, so it is not copied again.
- host -> shard, on ``pre_unshard`` (:meth:`HostShard.copy_back`): after the step. The compute stream waits for
  it at once, on the GPU: the next forward's gathers, issued after the compute stream's work, read the updated
  shard, and the CPU goes on to the next forward.

A side stream first waits for the compute stream's work so far (the allocation rule of [Note: stream overlap]);
the shard -> host copy also waits for the last host -> shard copy, which reads the same host buffer. The CPU
waits once per step (:meth:`HostShard.wait`), before the optimizer reads and writes the host buffers, for every
copy into them and for the previous step's copy out of them. Host buffers are allocated once and kept: nothing
is freed while a copy may use it. On a CPU device the same copies run synchronously.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from flatshard.engine.transport.streams import CommContext

__all__ = ["HostShard", "VersionMark"]

# What tells that a unit's device shard was written: the shard's identity, the version counter it shares with
# every view of it, and each parameter's own (an in-place write through a parameter bumps only that one).
VersionMark = tuple[int, int, tuple[int, ...]]


class HostShard:
    """Host copies of the start of one unit's shard and gradient shard, kept by its handle.

    Args:
        device: the compute device (host buffers are pinned when it is a CUDA device).

    Attributes:
        params: 1-D host tensor, the shard's dtype: elements ``[0, len)`` of the shard as the last step left them
            (the weights the optimizer steps on), or ``None`` before the first step.
        grads: 1-D host tensor, the gradient dtype: elements of the gradient shard, copied; ``None`` before the
            first copy.
        in_sync: the device shard's :data:`VersionMark` when ``params`` last equalled it; ``None``: copy it again.
        streams: the root's streams as of the last backward (``None`` before one): the step's copies use them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.params: torch.Tensor | None = None
        self.grads: torch.Tensor | None = None
        self.in_sync: VersionMark | None = None
        self.streams: CommContext | None = None
        # the gradient shard the last copy into ``grads`` read: (weak reference to its base, version, numel,
        # data_ptr) at the time; see valid_grad_copy
        self._grad_copy: tuple[Any, int, int, int] | None = None
        self._grad_event: Any | None = None  # recorded after the last copy into ``grads`` (CUDA)
        self._params_event: Any | None = None  # recorded after the last copy into ``params`` (CUDA)
        self._back_event: Any | None = None  # recorded after the last copy out of ``params`` (CUDA)

    @property
    def is_cuda(self) -> bool:
        return self.streams is not None and self.streams.is_cuda

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.streams is not None:
            return self.streams.host_empty(numel, dtype)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        return torch.empty(numel, dtype=dtype, pin_memory=pin)

    def _grads_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The gradient buffer, reallocated when it is too short or of another dtype (not while a copy into it may
        run: only the CPU's step and the copies the CPU waits for before it use it)."""
        grads = self.grads
        if grads is None or grads.numel() < numel or grads.dtype != dtype:
            self.wait()
            grads = self.grads = self._empty(numel, dtype)
            self._grad_copy = None
        return grads

    def reserve_params(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The weight buffer, at least ``numel`` elements; a new one is out of sync (``in_sync`` is ``None``)."""
        params = self.params
        if params is None or params.numel() < numel or params.dtype != dtype:
            self.wait()
            params = self.params = self._empty(numel, dtype)
            self.in_sync = None
        return params

    def reserve_grads(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The gradient buffer, at least ``numel`` elements of ``dtype``."""
        return self._grads_for(numel, dtype)

    # ------------------------------------------------------------------ gradient shard -> host
    def copy_grad(self, grad: torch.Tensor, streams: CommContext | None) -> None:
        """Start copying the gradient shard ``grad`` (1-D, all of it) into ``grads``; on CUDA on the post-backward
        stream, after the compute stream's work so far (see [Note: host copies and the streams])."""
        if streams is not None:
            self.streams = streams
        host = self._grads_for(grad.numel(), grad.dtype)[: grad.numel()]
        event = self._copy(host, grad, "post_backward")
        if event is not None:
            self._grad_event = event
        base = grad if grad._base is None else grad._base
        self._grad_copy = (weakref.ref(base), grad._version, grad.numel(), grad.data_ptr())

    def copy_grad_piece(self, offset: int, grad: torch.Tensor) -> None:
        """Start copying one parameter's gradient (any tensor) into ``grads`` at ``offset`` (the whole-shard copy
        no longer describes ``grads`` afterwards)."""
        assert self.grads is not None
        host = self.grads[offset : offset + grad.numel()]
        event = self._copy(host, grad.detach().reshape(-1), "post_backward")
        if event is not None:
            self._grad_event = event
        self._grad_copy = None

    def valid_grad_copy(self, grad: torch.Tensor | None) -> bool:
        """Whether ``grads`` holds ``grad`` (the current gradient shard) as it is now: the last copy read this very
        tensor, and nothing wrote it since (its version counter, shared by the parameters' ``.grad`` views, did
        not move: clipping, another backward's accumulation). A write torch does not count (through ``.data``)
        is not seen; see [Note: optimizer offload]."""
        copied = self._grad_copy
        if copied is None or grad is None:
            return False
        ref, version, numel, ptr = copied
        base = grad if grad._base is None else grad._base
        return ref() is base and grad._version == version and grad.numel() == numel and grad.data_ptr() == ptr

    def forget_grad_copy(self) -> None:
        self._grad_copy = None

    def before_grad_write(self, streams: CommContext | None) -> None:
        """The compute stream waits for the copies reading the gradient shard before it writes the shard again
        (called in backward: ``streams`` are the root's, which the step's copies use too)."""
        if streams is not None:
            self.streams = streams
            if self._grad_event is not None:
                streams.wait(self._grad_event)

    # ------------------------------------------------------------------ shard <-> host
    def copy_params(self, shard: torch.Tensor, numel: int) -> None:
        """Start copying ``shard[:numel]`` into ``params`` (the device shard was written since the last step)."""
        assert self.params is not None
        streams = self.streams
        if self.is_cuda and self._back_event is not None:
            assert streams is not None
            streams.wait(self._back_event, streams.post_backward)  # it still reads params: see the note
        event = self._copy(self.params[:numel], shard[:numel], "post_backward")
        if event is not None:
            self._params_event = event

    def copy_back(self, shard: torch.Tensor, numel: int) -> None:
        """Start copying ``params[:numel]`` into ``shard``; the compute stream waits for it (see [Note: host copies
        and the streams]), so anything that reads the shard later reads the update."""
        assert self.params is not None
        event = self._copy(shard[:numel], self.params[:numel], "pre_unshard")
        if event is not None:
            assert self.streams is not None
            self.streams.wait(event)
            self._back_event = event

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, side: str) -> Any | None:
        """``dst.copy_(src)``: on CUDA on the side stream ``side`` after the compute stream's work so far, returning
        an event recorded after it; elsewhere at once (``None``)."""
        streams = self.streams
        if streams is None or not streams.is_cuda:
            dst.copy_(src)
            return None
        stream = getattr(streams, side)
        streams.side_waits_compute(stream)
        with streams.on(stream):
            dst.copy_(src, non_blocking=True)
        return streams.record(stream)

    def wait(self) -> None:
        """The CPU waits for every copy into the host buffers and the last copy out of them (before the optimizer
        reads or writes them); a no-op where copies are synchronous."""
        for name in ("_grad_event", "_params_event", "_back_event"):
            event = getattr(self, name)
            if event is not None:
                event.synchronize()
                setattr(self, name, None)
