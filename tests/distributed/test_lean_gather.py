"""Full-state gathers reserve shared memory only where it is written, and a failed reservation falls back."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flatshard.engine.flat_param import FlatLayout
from flatshard.engine.state import stream_gather as gather
from flatshard.engine.transport import shm
from flatshard.testing import spawn

SHAPES = (torch.Size([40, 300]), torch.Size([7]), torch.Size([5000]))

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")


def _exchange(rank: int, world: int) -> dict[str, object]:
    _, own, peers = shm.exchange_segments(
        None, 1 << 20, "test", possible=True, open_peers=True, info={}, reserve_if=lambda _: rank != 0
    )
    out = {"own": own is not None, "reserved": own.reserved if own else None, "peers": sorted(peers)}
    for seg in (*peers.values(), *([own] if own else [])):
        seg.close()
    return out


@pytest.mark.timeout(120)
def test_segments_are_reserved_only_where_asked() -> None:
    results = spawn(_exchange, 3)
    assert [r["reserved"] for r in results] == [False, True, True], results
    assert all(r["own"] for r in results), results
    assert [r["peers"] for r in results] == [[1, 2], [0, 2], [0, 1]], results


def _gather(rank: int, world: int, keep_all: bool, fail_reserve_on: int) -> dict[str, object]:
    torch.set_num_threads(1)
    if rank == fail_reserve_on:

        def refuse(self: shm.Segment) -> None:
            raise OSError("sabotaged: no space in /dev/shm")

        shm.Segment.reserve = refuse  # type: ignore[method-assign]
    reserved: list[bool] = []
    real_exchange = gather.exchange_segments

    def exchange(*args: object, **kwargs: object) -> object:
        result = real_exchange(*args, **kwargs)  # type: ignore[arg-type]
        reserved.append(bool(result[1] is not None and result[1].reserved))
        return result

    gather.exchange_segments = exchange  # type: ignore[assignment]
    used: list[str] = []
    real_open = gather.FlatStream._open

    def open_(self: gather.FlatStream) -> None:
        real_open(self)
        used.append(self.transport)

    gather.FlatStream._open = open_  # type: ignore[method-assign]
    layout = FlatLayout(SHAPES, world)
    full = torch.arange(sum(s.numel() for s in SHAPES), dtype=torch.float32) * 0.5
    padded = torch.cat([full, torch.zeros(layout.padding)])
    lo, hi = layout.shard_range(rank)
    item = gather.GatherItem(
        None, torch.device("cpu"), layout, torch.float32, [0, 1, 2], [(0, padded[lo:hi].clone())]
    )
    keep = keep_all or rank == 0
    (res,) = gather.gather_items([item], keep, chunk_bytes=8192)
    parts = torch.split(full, list(layout.numels))
    ok = all(torch.equal(res[i], parts[i].view(SHAPES[i])) for i in range(3)) if keep else res == {}
    dist.barrier()
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"flatshard-gather-{os.getpid()}-")]
    return {"ok": ok, "used": used, "reserved": reserved, "left": left}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("keep_all", "fail_reserve_on", "transport", "reserved"),
    [
        (False, -1, "shm", [False, True]),  # rank 0 only keeps: its segment stays unreserved
        (True, -1, "shm", [True, True]),  # every rank sends to the other
        (False, 1, "collective", [False, False]),  # rank 1 cannot reserve: every rank falls back
    ],
)
def test_keeping_rank_reserves_nothing_and_failures_fall_back(
    keep_all: bool, fail_reserve_on: int, transport: str, reserved: list[bool]
) -> None:
    results = spawn(_gather, 2, keep_all, fail_reserve_on)
    for rank, r in enumerate(results):
        assert r["ok"], (rank, r)
        assert r["used"] == [transport], (rank, r)
        assert r["left"] == [], (rank, r)
    assert [r["reserved"] for r in results] == [[x] for x in reserved], results
