"""Communication time of a step, and how much of it compute does not hide, under the engine's schedule.

[Note: the communication time model]
A collective over ``W`` ranks on a link of bandwidth ``B`` (bytes per second each rank sends) and step latency
``a`` takes, as a ring does: all-gather of ``s`` bytes per rank ``(W-1) a + (W-1) s / B``; reduce-scatter of
an ``n``-byte input ``(W-1) a + (W-1)/W n / B``; all-reduce of ``n`` bytes twice that of a reduce-scatter. The
shard group's collectives (all-gathers, reduce-scatters) use the shard link, the replicate group's
all-reduces (hybrid sharding, NO_SHARD) the replicate link; collectives on one link run one after another.

Exposed time needs the schedule: the dry run records, for every collective of the step, how much of the step's
floating-point work came before it was issued and before it was waited for (a gather is waited for when its
unit computes, a reduction when the next unit's gradient is ready, see ``flatshard.engine.runtime``). Compute
runs at ``tflops``; a collective starts when it is issued and its link is free; compute that reaches a wait
before the collective is done stalls, and the stalls add up to the exposed communication time. Operators
without a FLOP formula (norms, activations, copies) count as free, so compute is underestimated and the exposed
time is an upper bound for a given throughput; the throughput is the achieved one (``tflops``), not the peak.
"""

from __future__ import annotations

from typing import NamedTuple

from flatshard.estimator.dry_run import Collective
from flatshard.estimator.options import Link

__all__ = ["StepTime", "collective_seconds", "step_time"]


class StepTime(NamedTuple):
    compute: float  # seconds of compute in the step
    communication: float  # seconds the links are busy
    exposed: float  # seconds compute waits for communication
    step: float  # compute + exposed


def collective_seconds(kind: str, nbytes: int, world: int, link: Link) -> float:
    """Seconds one collective takes (see [Note: the communication time model]); ``nbytes`` as ``comm_stats``
    counts them (all-gather: this rank's shard; reduce-scatter and all-reduce: the whole input)."""
    if world <= 1 or nbytes == 0:
        return 0.0
    steps = world - 1
    if kind == "all_gather":
        return steps * link.latency + steps * nbytes / link.bandwidth
    if kind == "reduce_scatter":
        return steps * link.latency + steps / world * nbytes / link.bandwidth
    return 2 * (steps * link.latency + steps / world * nbytes / link.bandwidth)


def step_time(
    collectives: list[Collective],
    flops: int,
    tflops: float,
    shard_world: int,
    replicate_world: int,
    shard_link: Link,
    replicate_link: Link,
) -> StepTime:
    """Simulate compute and the links over one step (see [Note: the communication time model])."""
    rate = tflops * 1e12
    durations = []
    for c in collectives:
        replicate = c.kind == "all_reduce"
        durations.append(
            collective_seconds(
                c.kind,
                c.nbytes,
                replicate_world if replicate else shard_world,
                replicate_link if replicate else shard_link,
            )
        )
    # Events at compute positions: issues before waits at the same position.
    events: list[tuple[int, int, int]] = []  # (flops position, 0 issue / 1 wait, collective index)
    for i, c in enumerate(collectives):
        events.append((c.issue_flops, 0, i))
        events.append((c.wait_flops if c.wait_flops is not None else flops, 1, i))
    events.sort()
    now = 0.0
    position = 0
    link_free = {"shard": 0.0, "replicate": 0.0}
    done = [0.0] * len(collectives)
    exposed = 0.0
    for at, what, i in events:
        now += max(0, at - position) / rate
        position = max(position, at)
        if what == 0:
            link = "replicate" if collectives[i].kind == "all_reduce" else "shard"
            start = max(now, link_free[link])
            done[i] = link_free[link] = start + durations[i]
        elif done[i] > now:
            exposed += done[i] - now
            now = done[i]
    now += max(0, flops - position) / rate
    return StepTime(flops / rate, sum(durations), exposed, now)
