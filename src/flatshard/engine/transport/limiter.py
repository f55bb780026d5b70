"""All-gather rate limiter (``limit_all_gathers``).

[Note: rate limiter]
The CPU thread can run far ahead of the GPU: with prefetching it would issue all-gathers (and
allocate their unsharded buffers) for many units while the GPU still computes an early one, so peak
memory would grow with the number of units and the allocator would thrash (``num_alloc_retries``).
The limiter bounds that: every reshard records a *free event* on the stream that last used the
buffer; before allocating the buffer of a new all-gather, the CPU waits on the free event of the
buffer freed ``max_in_flight`` all-gathers ago. With the default of two, at most two unsharded buffers
are in use or in flight at once beyond the ones being computed with.

On CPU the events are already complete when recorded (work there is synchronous from the CPU's point
of view), so the limiter costs a deque append; the event type is injectable for unit tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["AllGatherLimiter", "Event"]


class Event(Protocol):
    """What the limiter needs of an event: torch.cuda.Event has this shape."""

    def synchronize(self) -> None: ...


class AllGatherLimiter:
    """Blocks the CPU before an all-gather while ``max_in_flight`` freed buffers are still pending.

    Args:
        max_in_flight: how many freed-but-not-yet-complete buffers may be outstanding (default 2).
        enabled: ``False`` makes every call a no-op (``limit_all_gathers=False``).
    """

    def __init__(self, max_in_flight: int = 2, enabled: bool = True) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}.")
        self.max_in_flight = max_in_flight
        self.enabled = enabled
        self._free_events: deque[Event] = deque()
        self.waits = 0  # how many times the CPU blocked (for tests and benchmarks)

    def record_free(self, make_event: Callable[[], Event | None]) -> None:
        """Call right after a reshard frees an unsharded buffer; ``make_event`` records on its stream."""
        if not self.enabled:
            return
        event = make_event()
        if event is not None:
            self._free_events.append(event)

    def before_all_gather(self) -> None:
        """Call before allocating an all-gather's buffer: waits while too many frees are pending."""
        if not self.enabled:
            return
        while len(self._free_events) >= self.max_in_flight:
            self._free_events.popleft().synchronize()
            self.waits += 1

    def __len__(self) -> int:
        return len(self._free_events)
