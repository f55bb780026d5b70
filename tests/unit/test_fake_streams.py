"""The recording fake of the CUDA stream API (``tests/fake_streams.py``): it reports reads before a
wait, frees before a wait and host reads before a synchronize, accepts the same code with the waits, and on
one process checks the offload path: the copy that is the whole gather of a one-rank unit runs on the
pre-unshard stream, the gradient shard goes to pinned memory on the post-backward stream, and the CPU waits
once per backward before reading it."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.engine.transport.streams import CommContext
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.fake_streams import HOST, FakeCommContext, StreamRecorder, record_streams


def _context() -> tuple[StreamRecorder, FakeCommContext]:
    recorder = StreamRecorder()
    return recorder, FakeCommContext(torch.device("cpu"), recorder)


@pytest.mark.parametrize("waits", [False, True])
def test_a_read_on_compute_needs_the_side_streams_event(waits: bool) -> None:
    rec, ctx = _context()
    source = torch.arange(8.0)
    with rec.recording():
        gathered = torch.empty(8)  # allocated on compute
        ctx.side_waits_compute(ctx.unshard)
        with ctx.on(ctx.unshard):
            gathered.copy_(source * 2)
        event = ctx.record(ctx.unshard)
        if waits:
            ctx.wait(event)
        total = gathered.cumsum(0)
    assert total[-1] == 56
    if waits:
        assert rec.violations == []
    else:
        assert len(rec.violations) == 1
        assert rec.violations[0].startswith("compute reads") and "on unshard" in rec.violations[0]


@pytest.mark.parametrize("how", ["no_wait", "wait", "record_stream"])
def test_a_free_needs_the_users_waited_for(how: str) -> None:
    rec, ctx = _context()
    with rec.recording():
        grad = torch.ones(16) * 3  # written on compute
        out = torch.empty(16)
        ctx.side_waits_compute(ctx.post_backward)
        with ctx.on(ctx.post_backward):
            out.copy_(grad)  # the side stream reads ``grad``
        event = ctx.record(ctx.post_backward)
        if how == "record_stream":
            grad.record_stream(ctx.post_backward)
        if how == "wait":
            ctx.wait(event)
        del grad  # freed
        rec.collect()
    frees = [v for v in rec.violations if "freed (its last reference dropped)" in v]
    assert len(frees) == (1 if how == "no_wait" else 0), rec.violations


@pytest.mark.parametrize("synchronizes", [False, True])
def test_the_host_reads_a_pinned_buffer_after_synchronizing(synchronizes: bool) -> None:
    rec, ctx = _context()
    with rec.recording():
        grad = torch.ones(16)
        host = ctx.host_empty(16, torch.float32)
        ctx.side_waits_compute(ctx.post_backward)
        with ctx.on(ctx.post_backward):
            host.copy_(grad, non_blocking=True)
        if synchronizes:
            ctx.sync_host(ctx.post_backward)
        host.mul_(2)  # on the host
    assert rec.blocking == []
    assert [(e.stream, e.kind) for e in rec.log if e.kind == "d2h"] == [("post_backward", "d2h")]
    if synchronizes:
        assert rec.violations == []
    else:
        assert len(rec.violations) == 1 and rec.violations[0].startswith(f"{HOST} writes")


def test_a_blocking_copy_is_listed_and_orders_the_host() -> None:
    rec, ctx = _context()
    with rec.recording():
        host = ctx.host_empty(16, torch.float32)
        ctx.side_waits_compute(ctx.post_backward)
        with ctx.on(ctx.post_backward):
            host.copy_(torch.ones(16))  # not non_blocking: the CPU waits for the copy
        host.mul_(2)
    assert len(rec.blocking) == 1 and rec.blocking[0].startswith("d2h copy")
    assert rec.violations == []


def _offload_run(steps: int = 2) -> tuple[StreamRecorder, float]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = flatshard.shard(copy.deepcopy(reference), auto_wrap_policy={Block}, cpu_offload=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with record_streams(model) as rec:
        for step in range(steps):
            for micro in range(2):  # gradient accumulation: the second backward adds on the host
                idx, tgt = make_batch(10 * step + micro, 4)
                model.loss(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
    for step in range(steps):
        for micro in range(2):
            idx, tgt = make_batch(10 * step + micro, 4)
            reference.loss(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    mine = model.state_dict()
    diff = max((mine[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return rec, diff


def test_offload_on_one_rank_follows_the_protocol() -> None:
    rec, diff = _offload_run()
    assert diff <= 1e-6
    assert rec.violations == [] and rec.blocking == []
    assert rec.kinds_on("h2d") == {"pre_unshard"}  # the one-rank gather is a copy on the side stream
    assert rec.kinds_on("d2h") == {"post_backward"}
    host_waits = [e for e in rec.log if e.kind == "synchronize"]
    assert len(host_waits) == 4 and all("post_backward" in e.detail for e in host_waits)  # once per backward
    assert all("sync_host" in e.where for e in host_waits)


def test_offload_without_the_host_wait_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CommContext, "sync_host", lambda self, stream: None)
    rec, _ = _offload_run(steps=1)
    reads = [v for v in rec.violations if v.startswith(f"{HOST} reads")]
    assert reads and "_copy_to_host" in reads[0], rec.violations
