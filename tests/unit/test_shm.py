"""The shared-memory transport, with every "rank" a ShmGroup in this process (no process group needed).

Each rank owns a segment file and maps its peers' files, exactly as ranks of one host do; the worker
threads and cross-mapping futexes are the real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from flatshard.engine.transport import shm
from flatshard.engine.transport.pieces import FlatPieces

pytestmark = pytest.mark.skipif(shm._futex() is None, reason="the transport needs Linux x86-64")

SLOT = 4096  # small slots: every collective below takes many steps


def _ranks(
    tmp_path: Path, world: int, pids: list[int] | None = None, timeout: float = 60.0
) -> list[shm.ShmGroup]:
    nbytes = shm._HEADER + 2 * SLOT
    paths = [str(tmp_path / f"seg{r}") for r in range(world)]
    owns = [shm.Segment(p, nbytes, create=True) for p in paths]
    groups = []
    for r in range(world):
        peers = {q: shm.Segment(paths[q], nbytes, create=False) for q in range(world) if q != r}
        groups.append(
            shm.ShmGroup(
                r, world, owns[r], peers, pids or [os.getpid()] * world, list(range(world)), SLOT, timeout
            )
        )
    return groups


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 1000, 4099])
def test_collectives_match_the_reference(tmp_path: Path, world: int, dtype: torch.dtype, n: int) -> None:
    ranks = _ranks(tmp_path, world)
    # all-gather: every rank's shard, in rank order
    shards = [_values(n, dtype, r) for r in range(world)]
    outs = [torch.full((world * n,), 7, dtype=dtype) for _ in range(world)]
    works = [g.all_gather(outs[r], shards[r]) for r, g in enumerate(ranks)]
    for w in works:
        w.wait()
    for out in outs:
        assert torch.equal(out, torch.cat(shards))
    # reduce-scatter: the sum of slice r over ranks, added in rank order (bitwise for every dtype)
    fulls = [_values(world * n, dtype, 10 + r) for r in range(world)]
    outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
    works = [g.reduce_scatter(outs[r], fulls[r]) for r, g in enumerate(ranks)]
    for w in works:
        w.wait()
    for r, out in enumerate(outs):
        expected = fulls[0][r * n : (r + 1) * n].clone()
        for q in range(1, world):
            expected += fulls[q][r * n : (r + 1) * n]
        assert torch.equal(out, expected)
    # all-reduce in place: equal on every rank
    tensors = [_values(n, dtype, 20 + r) for r in range(world)]
    expected = tensors[0].clone()
    for t in tensors[1:]:
        expected += t
    works = [g.all_reduce(tensors[r]) for r, g in enumerate(ranks)]
    for w in works:
        w.wait()
    for t in tensors:
        assert torch.equal(t, expected)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_reads_pieces_like_the_packed_tensor(tmp_path: Path, world: int) -> None:
    """A gradient left in per-parameter tensors (gaps are zeros) reduces bitwise like its packed copy."""
    ranks, n = _ranks(tmp_path, world), 2500  # several steps of the small slots per rank
    packed, pieces = [], []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        parts = [(0, torch.randn(40, 30, generator=g)), (1500, torch.randn(7, generator=g))]
        parts.append((3000, torch.randn(world * n - 3100, generator=g)))
        dense = torch.zeros(world * n)
        for offset, t in parts:
            dense[offset : offset + t.numel()] = t.reshape(-1)
        packed.append(dense)
        pieces.append(FlatPieces(world * n, torch.float32, torch.device("cpu"), parts))
    piece = weakref.ref(pieces[0]._pieces[0])  # freed by the transport once the collective is done
    results = []
    for source in (packed, pieces):
        outs = [torch.full((n,), 9.0) for _ in range(world)]
        for w in [g.reduce_scatter(outs[r], source[r]) for r, g in enumerate(ranks)]:
            w.wait()
        results.append(outs)
    del parts
    assert piece() is None
    for dense_out, pieces_out in zip(*results, strict=True):
        assert torch.equal(dense_out, pieces_out)
    assert torch.equal(results[1][0], sum(p[:n] for p in packed))


def test_collectives_in_flight_run_in_issue_order(tmp_path: Path) -> None:
    ranks = _ranks(tmp_path, 2)
    n = 3000
    shards = [[_values(n, torch.float32, 100 * k + r) for r in range(2)] for k in range(5)]
    outs = [[torch.empty(2 * n) for _ in range(2)] for _ in range(5)]
    works = [[g.all_gather(outs[k][r], shards[k][r]) for k in range(5)] for r, g in enumerate(ranks)]
    for per_rank in works:
        for w in reversed(per_rank):  # waiting in another order changes nothing
            w.wait()
    for k in range(5):
        for r in range(2):
            assert torch.equal(outs[k][r], torch.cat(shards[k]))


def test_ranks_issuing_different_collectives_are_told(tmp_path: Path) -> None:
    a, b = _ranks(tmp_path, 2)
    wa = a.all_gather(torch.empty(16), torch.ones(8))
    wb = b.all_reduce(torch.ones(8))
    for w in (wa, wb):
        with pytest.raises(
            RuntimeError,
            match="(?s)ranks issued different collectives.*all_gather.*all_reduce|"
            "ranks issued different collectives.*all_reduce.*all_gather",
        ):
            w.wait()
    # the ranks are out of step now: later collectives fail at once instead of exchanging garbage
    with pytest.raises(RuntimeError, match="stopped"):
        a.all_reduce(torch.ones(8)).wait()


def test_a_peer_that_exited_is_reported(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # its pid is free now
    a, _ = _ranks(tmp_path, 2, pids=[os.getpid(), proc.pid])
    with pytest.raises(
        RuntimeError,
        match=rf"rank 1 \(pid {proc.pid}\) exited while this rank waited for it in a shared-memory all_gather",
    ):
        a.all_gather(torch.empty(16), torch.ones(8)).wait()


def test_a_peer_that_never_comes_is_reported_after_the_timeout(tmp_path: Path) -> None:
    a, _ = _ranks(tmp_path, 2, timeout=0.6)
    with pytest.raises(RuntimeError, match=r"waited 1 s for rank 1 in a shared-memory reduce_scatter.*HINT"):
        a.reduce_scatter(torch.empty(8), torch.ones(16)).wait()


def test_names_left_by_processes_that_no_longer_run_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path))
    names = {
        "dead": f"flatshard-comm-{proc.pid}-abc",
        "dead_gather": f"flatshard-gather-{proc.pid}-def",
        "alive": f"flatshard-comm-{os.getpid()}-abc",
        "not_ours": f"other-comm-{proc.pid}-abc",
        "no_pid": "flatshard-comm-x-abc",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"")
    shm.remove_stale_segments()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("alive", "not_ours", "no_pid")
    )


def test_a_work_done_just_after_a_wait_slice_ran_out_is_not_an_error() -> None:
    """``wait_sliced`` waits in slices; a work that completes between a slice's timeout and the check after it
    finished fine: the wait returns (it raised the slice's "timed out" before)."""
    from flatshard.engine.transport import watchdog

    class LateWork:
        def __init__(self) -> None:
            self.done = False

        def wait(self, timeout: object = None) -> bool:
            if not self.done:
                self.done = True  # completes right after this slice times out
                raise RuntimeError("shared-memory collective: wait timed out; the work is still pending")
            return True

        def is_completed(self) -> bool:
            return self.done

    watchdog.wait_sliced(LateWork(), None)

    class FailedWork(LateWork):
        def wait(self, timeout: object = None) -> bool:
            if self.done:
                raise RuntimeError("the peer exited")
            return super().wait(timeout)

    with pytest.raises(RuntimeError, match="the peer exited"):  # its own error, not the slice's timeout
        watchdog.wait_sliced(FailedWork(), None)
