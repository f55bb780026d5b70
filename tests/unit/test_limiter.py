"""The all-gather rate limiter with fake events (no GPU needed)."""

from __future__ import annotations

import pytest

from flatshard.engine.transport import watchdog
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


class PolledEvent:
    """A CUDA-like event that completes after ``polls`` queries; ``synchronize`` must not be called."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        raise AssertionError("a labelled wait with a desync limit polls instead of blocking")


def _label() -> watchdog.Label:
    return watchdog.Label("all_gather", 8, "float32", (0, 1), 3, ("blocks.0", "forward", 1), "0")


def test_a_labelled_wait_polls_and_records_the_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[watchdog.Label | None] = []
    monkeypatch.setattr(watchdog, "limit", lambda: 60.0)
    monkeypatch.setattr(watchdog, "wait_slice", lambda: 0.0)  # record at every poll
    monkeypatch.setattr(watchdog, "blocked", lambda label, since: seen.append(label))
    limiter = AllGatherLimiter(max_in_flight=1)
    limiter.record_free(lambda: PolledEvent(3), _label())
    limiter.before_all_gather()
    assert seen and all(label == _label() for label in seen) and limiter.waits == 1
    assert watchdog.current_wait() is None  # the wait is over: nothing left for the heartbeat


def test_without_a_limit_or_label_the_wait_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(watchdog, "limit", lambda: None)
    limiter = AllGatherLimiter(max_in_flight=1)
    limiter.record_free(lambda: FakeEvent("a", log), _label())
    limiter.before_all_gather()
    monkeypatch.setattr(watchdog, "limit", lambda: 60.0)
    limiter.record_free(lambda: FakeEvent("b", log))  # no label: nothing to report, block
    limiter.before_all_gather()
    assert log == ["sync a", "sync b"]
