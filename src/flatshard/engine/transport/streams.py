"""Named streams and events, created once by the root; on CPU every stream is the current one.

[Note: stream overlap]
Side streams let communication (and activation copies) overlap compute on CUDA:

- ``unshard``: all-gathers. A unit's gather runs here while the compute stream still works on the
  previous unit; compute waits on an event recorded after the gather, right before it needs the data.
- ``pre_unshard``: casts / copies that produce an all-gather's input (low-precision copies of the
  shard), so they do not queue behind compute kernels.
- ``post_backward``: reduce-scatters of gradients, so a unit's gradient reduction overlaps the
  backward of the units before it. Under hybrid sharding the all-reduce across shard groups follows the
  reduce-scatter on this stream, issued at once and asynchronously like it (on the compute stream it
  would stall the backward for its whole duration); with CPU offload the copy of the reduced shard
  into pinned host memory follows too. The compute stream waits for one event recorded after all of
  it, at the next unit's post-backward, where the reduced gradient is next used and the buffers the
  stream read may be freed.
- ``offload`` / ``reload`` (``activation_offload``): copies of a unit's saved activations to pinned host
  memory when its forward returns, and back to the device one unit ahead of its backward, so neither
  direction queues behind compute or communication (see [Note: activation offload]).

Allocation rule (why there are no ``record_stream`` calls): every buffer is allocated on the compute
stream, before a side stream touches it, and a side stream first waits for the compute stream
(an event recorded at issue time). The caching allocator then orders reuse of a freed block with
all compute work, and a side stream never writes into a block that compute may still read. A buffer a
side stream reads (the unsharded gradient for a reduce-scatter) is kept alive by reference, in the
pending-work record, until the compute stream has waited for that side stream's event.

Host memory (CPU offload): no stream's wait orders the CPU. A pinned buffer that the post-backward
stream copies into (:meth:`CommContext.host_empty`) is read on the CPU only after
:meth:`CommContext.sync_host` has waited for that stream, once per backward, at its end (see [Note: CPU
offload] in ``flatshard.engine.handle``); the pinned-memory allocator keeps a freed block from reuse until
the copies that used it are done.

On CPU (gloo), collectives are issued with ``async_op=True`` and their work handles waited on when the
data is needed: the same overlap, without streams. ``tests/fake_streams.py`` replays the CUDA
protocol on CPU, with streams and events that record what each stream did and check the ordering above.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

__all__ = ["CommContext"]


class CommContext:
    """The root's streams for ``device`` (all ``None`` on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda" and torch.cuda.is_available()
        self.compute: Any | None = None
        self.unshard: Any | None = None
        self.pre_unshard: Any | None = None
        self.post_backward: Any | None = None
        self.offload: Any | None = None
        self.reload: Any | None = None
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(device)
            # High priority: communication should not wait behind queued compute kernels.
            high = -1
            self.unshard = torch.cuda.Stream(device, priority=high)
            self.pre_unshard = torch.cuda.Stream(device, priority=high)
            self.post_backward = torch.cuda.Stream(device, priority=high)
            self.offload = torch.cuda.Stream(device)
            self.reload = torch.cuda.Stream(device)

    def refresh_compute(self) -> None:
        """The compute stream is whatever stream is current when an iteration starts."""
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(self.device)

    def stream_names(self) -> dict[Any, str]:
        """Debug map from stream to its name (e.g. to label a profiler trace)."""
        return {
            s: name
            for name, s in (
                ("compute", self.compute),
                ("unshard", self.unshard),
                ("pre_unshard", self.pre_unshard),
                ("post_backward", self.post_backward),
                ("offload", self.offload),
                ("reload", self.reload),
            )
            if s is not None
        }

    @contextmanager
    def on(self, stream: Any | None) -> Iterator[None]:
        """Run the block with ``stream`` current (no-op on CPU)."""
        with torch.cuda.stream(stream) if self.is_cuda and stream is not None else nullcontext():
            yield

    def record(self, stream: Any | None = None) -> Any | None:
        """An event recorded on ``stream`` (default: compute), or ``None`` on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.compute)
        return event

    def wait(self, event: Any | None, stream: Any | None = None) -> None:
        """Make ``stream`` (default: compute) wait for ``event``; CPU never blocks here."""
        target = stream if stream is not None else self.compute
        if event is not None and target is not None:
            target.wait_event(event)

    def side_waits_compute(self, side: Any | None) -> None:
        """A side stream waits for the compute work issued so far (see the allocation rule)."""
        if self.is_cuda and side is not None:
            side.wait_event(self.record(self.compute))

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D CPU buffer for a copy from the device: pinned on CUDA, so that the copy does not block."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda)

    def sync_host(self, stream: Any | None) -> None:
        """The CPU waits for the work queued on ``stream`` so far (before reading what it copied to host
        memory); a no-op on CPU, where that work is done when it returns."""
        event = self.record(stream) if stream is not None else None
        if event is not None:
            event.synchronize()
