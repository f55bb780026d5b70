"""Named streams and events, created once by the root; on CPU every stream is the current one.

[Note: stream overlap]
Three side streams let communication overlap compute on CUDA:

- ``unshard``: all-gathers. A unit's gather runs here while the compute stream still works on the
  previous unit; compute waits on an event recorded after the gather, right before it needs the data.
- ``pre_unshard``: casts / copies that produce an all-gather's input (low-precision copies of the
  shard), so they do not queue behind compute kernels.
- ``post_backward``: reduce-scatters of gradients, so a unit's gradient reduction overlaps the
  backward of the units before it.

Allocation rule (why there are no ``record_stream`` calls): every buffer is allocated on the compute
stream, before a side stream touches it, and a side stream first waits for the compute stream
(an event recorded at issue time). The caching allocator then orders reuse of a freed block with
all compute work, and a side stream never writes into a block that compute may still read. A buffer a
side stream reads (the unsharded gradient for a reduce-scatter) is kept alive by reference, in the
pending-work record, until the compute stream has waited for that side stream's event.

On CPU (gloo), collectives are issued with ``async_op=True`` and their work handles waited on when the
data is needed: the same overlap, without streams.
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
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(device)
            # High priority: communication should not wait behind queued compute kernels.
            high = -1
            self.unshard = torch.cuda.Stream(device, priority=high)
            self.pre_unshard = torch.cuda.Stream(device, priority=high)
            self.post_backward = torch.cuda.Stream(device, priority=high)

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
