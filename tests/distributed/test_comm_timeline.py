"""``comm.timeline()``: every collective of a training step recorded with its bytes, when the transport ran
it and when the training thread waited, on the shared-memory transport and on gloo."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.transport import comm, shm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _run(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    everyone = list(range(world))
    groups = {"shm": dist.new_group(everyone, backend="gloo")}
    os.environ["FLATSHARD_SHM"] = "0"
    groups["gloo"] = dist.new_group(everyone, backend="gloo")
    assert shm.shm_group(groups["gloo"]) is None
    del os.environ["FLATSHARD_SHM"]
    has_shm = shm.shm_group(groups["shm"]) is not None
    x, y = make_batch(0, 2)
    for (name, pg), prefetch in zip(groups.items(), ("BACKWARD_PRE", "BACKWARD_POST")):
        torch.manual_seed(0)
        model = flatshard.shard(
            TinyGPT(n_layer=2), auto_wrap_policy={Block}, process_group=pg, backward_prefetch=prefetch
        )
        # a first iteration records the order that prefetching follows from then on
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        units = sum(1 for s in flatshard.engine.unit_states(model) for h in s.handles)
        comm.comm_stats.clear()
        with comm.timeline() as records:
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        kinds = [r.kind for r in records]
        # FULL_SHARD: gathered for forward (the root stays gathered into backward), again for backward;
        # no prefetch gathers a unit whose backward already ran (the root's gradient is complete last)
        assert kinds.count("all_gather") == 2 * units - 1, (name, prefetch, kinds)
        assert kinds[-1] != "all_gather", (name, prefetch, kinds)
        assert kinds.count("reduce_scatter") == units, (name, kinds)
        for kind in ("all_gather", "reduce_scatter"):
            assert sum(r.nbytes for r in records if r.kind == kind) == comm.comm_stats[kind]
        for r in records:
            if r.kind == "all_reduce":  # which parameters got gradients: waited on at once
                continue
            assert r.waited, (name, r)  # every gather and reduction was waited for once it was needed
            assert all(r.issued_ns <= a <= b for a, b in r.waited)
            if name == "shm" and has_shm:
                start, end = r.busy  # the worker ran it after it was issued and ended before the wait did
                assert r.issued_ns <= start <= end <= r.waited[-1][1], r
            else:
                assert r.busy is None  # a backend's own threads are not observable
        issued = [r.issued_ns for r in records]
        assert issued == sorted(issued)
    with comm.timeline() as outer:
        with comm.timeline() as inner:
            comm.all_reduce_flat(torch.ones(4), groups["shm"]).wait()
        comm.all_reduce_flat(torch.ones(4), groups["shm"], async_op=False)
    assert len(inner) == 1 and len(outer) == 1 and outer[0].waited  # synchronous calls are timed too
    comm.all_reduce_flat(torch.ones(4), groups["shm"]).wait()
    assert len(outer) == 1 and comm.comm_stats.recording is None  # off outside the block


def test_timeline_records_every_collective_on_both_transports() -> None:
    spawn(_run, 2)
