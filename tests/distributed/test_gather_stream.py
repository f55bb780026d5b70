"""Full-state gathers: every transport delivers every element exactly once, and failures fall back."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flatshard.engine.flat_param import FlatLayout
from flatshard.engine.state import stream_gather as gather
from flatshard.testing import spawn

from ._sabotage import fail_segments

SHAPES = (torch.Size([7, 300]), torch.Size([5]), torch.Size([1000]), torch.Size([33, 17]), torch.Size([0]))


def _full(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    total = sum(s.numel() for s in SHAPES)
    return (torch.randn(total, generator=g) * 100).to(dtype)


def _items(rank: int, world: int) -> tuple[list[gather.GatherItem], list[dict[int, torch.Tensor]]]:
    layout = FlatLayout(SHAPES, world)
    items, expected = [], []
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        full = _full(dtype)
        padded = torch.cat([full, torch.zeros(layout.padding, dtype=dtype)])
        lo, hi = layout.shard_range(rank)
        parts = torch.split(full, list(layout.numels))
        # Parameters: the whole shard as one piece.
        items.append(
            gather.GatherItem(
                None,
                torch.device("cpu"),
                layout,
                dtype,
                list(range(len(SHAPES))),
                [(0, padded[lo:hi].clone())],
            )
        )
        expected.append({i: parts[i].view(SHAPES[i]) for i in range(len(SHAPES))})
        # Optimizer-like: one piece per parameter, the second parameter without state (not wanted).
        pieces = [
            (
                info.offset_in_shard,
                padded[lo + info.offset_in_shard : lo + info.offset_in_shard + info.numel_in_shard].clone(),
            )
            for i, info in enumerate(layout.shard_infos(rank))
            if info.numel_in_shard and i != 1
        ]
        wanted = [i for i in range(len(SHAPES)) if i != 1]
        items.append(gather.GatherItem(None, torch.device("cpu"), layout, dtype, wanted, pieces))
        expected.append({i: parts[i].view(SHAPES[i]) for i in wanted})
    return items, expected


def _run(rank: int, world: int, keep_all: bool, chunk_bytes: int, sabotage: str) -> dict[str, object]:
    torch.set_num_threads(1)
    if sabotage == "peer_cannot_map" and rank == 0:
        fail_segments(creating=False)
    used: list[str] = []
    real_open = gather.FlatStream._open

    def open_(self: gather.FlatStream) -> None:
        real_open(self)
        used.append(self.transport)

    gather.FlatStream._open = open_  # type: ignore[method-assign]
    keep = keep_all or rank == 0
    items, expected = _items(rank, world)
    results = gather.gather_items(items, keep, chunk_bytes)
    ok = True
    for res, exp in zip(results, expected):
        if keep:
            ok &= sorted(res) == sorted(exp) and all(torch.equal(res[i], exp[i]) for i in exp)
            # Each output is its own storage: safe to save, free or export one at a time.
            ok &= len({t.untyped_storage().data_ptr() for t in res.values() if t.numel()}) == len(
                [t for t in res.values() if t.numel()]
            )
        else:
            ok &= res == {}
    dist.barrier()
    shm_left = (
        [f for f in os.listdir("/dev/shm") if f.startswith("flatshard-")] if os.path.isdir("/dev/shm") else []
    )
    return {"ok": ok, "used": used, "shm_left": shm_left}


CASES = [
    # world, keep_all, chunk_bytes, FLATSHARD_SHM, sabotage, expected transport
    (2, False, 4096, "1", "", "shm"),  # many chunks
    (3, False, 1 << 20, "1", "", "shm"),
    (3, True, 4096, "1", "", "shm"),  # every rank keeps
    (3, False, 1 << 20, "0", "", "collective"),  # gather to rank 0
    (2, True, 4096, "0", "", "collective"),  # all_gather, many chunks
    (3, False, 4096, "1", "peer_cannot_map", "collective"),  # rank 0 cannot map: every rank falls back
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "keep_all", "chunk_bytes", "shm", "sabotage", "transport"), CASES)
def test_gather_items_delivers_every_element(
    world: int, keep_all: bool, chunk_bytes: int, shm: str, sabotage: str, transport: str
) -> None:
    if shm == "1" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    results = spawn(_run, world, keep_all, chunk_bytes, sabotage, env={"FLATSHARD_SHM": shm})
    for rank, r in enumerate(results):
        assert r["ok"], (rank, r)
        assert r["shm_left"] == [], r
        assert r["used"] == [transport], (rank, r)
