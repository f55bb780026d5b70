"""The all-gather rate limiter with fake events (no GPU needed)."""

from __future__ import annotations

import pytest

from flatshard.engine.transport.limiter import AllGatherLimiter


class FakeEvent:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")


def test_waits_on_the_buffer_freed_two_gathers_ago() -> None:
    log: list[str] = []
    limiter = AllGatherLimiter()
    limiter.before_all_gather()  # nothing freed yet: no wait
    limiter.record_free(lambda: FakeEvent("a", log))
    limiter.before_all_gather()  # one pending free: still fine
    limiter.record_free(lambda: FakeEvent("b", log))
    limiter.before_all_gather()  # two pending: wait for the older one (a)
    assert log == ["sync a"] and len(limiter) == 1 and limiter.waits == 1
    limiter.record_free(lambda: FakeEvent("c", log))
    limiter.before_all_gather()
    assert log == ["sync a", "sync b"]


def test_disabled_limiter_never_waits() -> None:
    log: list[str] = []
    limiter = AllGatherLimiter(enabled=False)
    for name in "abcd":
        limiter.record_free(lambda name=name: FakeEvent(name, log))
        limiter.before_all_gather()
    assert log == [] and len(limiter) == 0


def test_cpu_events_are_not_queued() -> None:
    limiter = AllGatherLimiter()
    limiter.record_free(lambda: None)  # CPU: CommContext.record returns None
    limiter.before_all_gather()
    assert len(limiter) == 0 and limiter.waits == 0


def test_rejects_bad_depth() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        AllGatherLimiter(max_in_flight=0)
