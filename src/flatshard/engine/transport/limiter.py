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

On NCCL the limiter is where a rank's CPU blocks when a gather never completes (a desync: a peer skipped
the step). Each free event remembers the label of the all-gather that filled the freed buffer, and with a
desync limit set the CPU polls the event instead of blocking in ``synchronize``, recording "waiting in that
all-gather" for the desync detector in slices (see [Note: finding a desync]). Polling spins on
``query()`` and yields the interpreter lock between polls, as ``cudaEventSynchronize`` spins by default:
no added latency.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from flatshard.engine.transport import watchdog

__all__ = ["AllGatherLimiter", "Event"]


class Event(Protocol):
    """What the limiter needs of an event: torch.cuda.Event has this shape (``query`` is optional)."""

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
        self._free_events: deque[tuple[Event, watchdog.Label | None]] = deque()
        self.waits = 0  # how many times the CPU blocked (for tests and benchmarks)

    def record_free(
        self, make_event: Callable[[], Event | None], label: watchdog.Label | None = None
    ) -> None:
        """Call right after a reshard frees an unsharded buffer; ``make_event`` records on its stream.
        ``label``: the all-gather that filled the buffer (what a desync report says this CPU waits for)."""
        if not self.enabled:
            return
        event = make_event()
        if event is not None:
            self._free_events.append((event, label))

    def before_all_gather(self) -> None:
        """Call before allocating an all-gather's buffer: waits while too many frees are pending."""
        if not self.enabled:
            return
        while len(self._free_events) >= self.max_in_flight:
            event, label = self._free_events.popleft()
            _wait_event(event, label)
            self.waits += 1

    def __len__(self) -> int:
        return len(self._free_events)


def _wait_event(event: Event, label: watchdog.Label | None) -> None:
    """Block until ``event`` completes; with a desync limit, poll it so a desync is reported, not a hang."""
    query = getattr(event, "query", None)
    if query is None or label is None or watchdog.group_limit(label.state) is None or query():
        event.synchronize()
        return
    since = look = time.monotonic()
    try:
        while not query():
            time.sleep(0)  # let the heartbeat (and an async save's thread) run
            now = time.monotonic()
            if now >= look:
                watchdog.blocked(label, since)
                look = now + watchdog.wait_slice()
    finally:
        watchdog.unblocked()
