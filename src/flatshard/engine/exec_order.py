"""Execution order of units: recorded on the first iteration, validated on later ones, used to prefetch.

[Note: execution order]
Prefetching issues the all-gather of the unit that runs *next* before the current one computes, so
it needs to know which unit that is. The first forward records the order in which units start
(pre-forward) and finish (post-forward). Backward runs units in the reverse of the order in which
their forwards *finished* (the root, which finishes last, starts backward first). Later iterations
check each unit against the record; the first mismatch (a data-dependent branch, a unit skipped)
warns once and turns prefetching off for good: every unit still gathers itself just in time, so a
wrong guess can cost speed, never correctness. Only training forwards (gradients on) are recorded and
checked: an evaluation step may run units in another order (a decode loop, a partial model), so it
neither changes the record nor prefetches by it (a unit prefetched but not run would stay gathered).
"""

from __future__ import annotations

import warnings
from typing import Generic, TypeVar

__all__ = ["ExecOrder"]

T = TypeVar("T")


class ExecOrder(Generic[T]):
    """Per-root record of the unit order; ``T`` is the unit-state type."""

    def __init__(self) -> None:
        self.pre_forward: list[T] = []
        self.post_forward: list[T] = []
        self.recorded = False  # the first full forward has been seen
        self.valid = True  # no deviation seen since
        self._pre_idx = 0
        self._post_idx = 0
        self._forward_next: dict[int, T] = {}
        self._backward_next: dict[int, T] = {}

    def begin_forward(self) -> None:
        self._pre_idx = self._post_idx = 0

    def _check(self, record: list[T], idx: int, unit: T, what: str) -> None:
        if not self.valid:
            return
        if not self.recorded:
            record.append(unit)
        elif idx >= len(record) or record[idx] is not unit:
            self.valid = False
            warnings.warn(
                f"flatshard: the order of unit {what}s changed after the first iteration (at position {idx}). "
                "Prefetching is turned off for this model; results are unaffected. HINT: this happens with "
                "data-dependent control flow; pass backward_prefetch=None, forward_prefetch=False to silence it.",
                stacklevel=4,
            )

    def note_pre_forward(self, unit: T) -> None:
        self._check(self.pre_forward, self._pre_idx, unit, "forward")
        self._pre_idx += 1

    def note_post_forward(self, unit: T) -> None:
        self._check(self.post_forward, self._post_idx, unit, "forward")
        self._post_idx += 1

    def finish_forward(self) -> None:
        """Called when the root's forward ends: the first call completes the record."""
        if self.recorded:
            if self.valid and (
                self._pre_idx != len(self.pre_forward) or self._post_idx != len(self.post_forward)
            ):
                self._check(self.pre_forward, self._pre_idx, None, "forward")  # type: ignore[arg-type]
            return
        self.recorded = True
        self._forward_next = _next_map(self.pre_forward)
        self._backward_next = _next_map(list(reversed(self.post_forward)))

    def next_forward(self, unit: T) -> T | None:
        """The unit whose forward follows ``unit``'s, if the record is usable."""
        return self._forward_next.get(id(unit)) if self.recorded and self.valid else None

    def next_backward(self, unit: T) -> T | None:
        """The unit whose backward follows ``unit``'s, if the record is usable."""
        return self._backward_next.get(id(unit)) if self.recorded and self.valid else None


def _next_map(order: list[T]) -> dict[int, T]:
    """unit -> the next different unit after its first occurrence."""
    out: dict[int, T] = {}
    for i, unit in enumerate(order):
        if id(unit) in out:
            continue
        for later in order[i + 1 :]:
            if later is not unit:
                out[id(unit)] = later
                break
    return out
