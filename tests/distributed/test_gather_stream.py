"""Streamed full-state gathers: every transport delivers every element exactly once, chunked or not."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flatshard.engine import gather
from flatshard.engine.flat_param import FlatLayout
from flatshard.testing import spawn

SHAPES = (torch.Size([7, 300]), torch.Size([5]), torch.Size([1000]), torch.Size([33, 17]))


def _full(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    total = sum(s.numel() for s in SHAPES)
    return (torch.randn(total, generator=g) * 100).to(dtype)


def _run(rank: int, world: int, keep_all: bool, chunk_bytes: int) -> dict[str, object]:
    torch.set_num_threads(1)
    layout = FlatLayout(SHAPES, world)
    keep = keep_all or rank == 0
    out: dict[str, object] = {}
    with gather.open_streams(keep, chunk_bytes) as stream_of:
        stream = stream_of(None, torch.device("cpu"))
        out["transport"] = stream.transport
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            full = _full(dtype)
            padded = torch.cat([full, torch.zeros(layout.padding, dtype=dtype)])
            lo, hi = layout.shard_range(rank)
            infos = layout.shard_infos(rank)
            # Parameters: the whole shard as one piece.  Optimizer-like: one piece per parameter, with the
            # second parameter left out (no state): its elements must arrive as zeros.
            for name, pieces, skip in (
                ("flat", [(0, padded[lo:hi].clone())], None),
                (
                    "pieces",
                    [
                        (
                            info.offset_in_shard,
                            padded[
                                lo + info.offset_in_shard : lo + info.offset_in_shard + info.numel_in_shard
                            ].clone(),
                        )
                        for i, info in enumerate(infos)
                        if info.numel_in_shard and i != 1
                    ],
                    1,
                ),
            ):
                wanted = [i for i in range(len(SHAPES)) if i != skip]
                outputs = gather.UnitOutputs(layout, wanted, dtype, torch.device("cpu")) if keep else None
                stream.gather(layout.shard_numel, dtype, pieces, outputs.deliver if outputs else None)
                if outputs is not None:
                    expected = torch.split(full, list(layout.numels))
                    ok = all(torch.equal(outputs.tensors[i], expected[i].view(SHAPES[i])) for i in wanted)
                    out[f"{name}/{dtype}"] = ok
    dist.barrier()
    out["shm_left"] = (
        [f for f in os.listdir("/dev/shm") if f.startswith("flatshard-")] if os.path.isdir("/dev/shm") else []
    )
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "keep_all", "chunk_bytes", "shm"),
    [
        (2, False, 4096, "1"),  # many chunks, shared memory
        (3, True, 4096, "1"),  # every rank keeps
        (3, False, 1 << 20, "0"),  # collective: gather to rank 0
        (2, True, 4096, "0"),  # collective: all_gather, many chunks
    ],
)
def test_stream_delivers_every_element(world: int, keep_all: bool, chunk_bytes: int, shm: str) -> None:
    results = spawn(_run, world, keep_all, chunk_bytes, env={"FLATSHARD_SHM": shm})
    expected_transport = "shm" if shm == "1" and os.path.isdir("/dev/shm") else "collective"
    for rank, r in enumerate(results):
        assert r["transport"] == expected_transport, (rank, r)
        if rank == 0 or keep_all:
            checks = {k: v for k, v in r.items() if "/" in k}
            assert len(checks) == 6 and all(checks.values()), (rank, checks)
        assert r["shm_left"] == [], r
