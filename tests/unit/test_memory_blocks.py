"""Large transient CPU blocks: mappings of their own that views (as autograd saves them) keep seeing."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from flatshard.engine.transport import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mappings are used on Linux")

BIG = (8 << 20) // 4  # 8 MiB of float32: above the size where blocks get mappings of their own


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_storage_returns_to_the_system_and_views_see_the_next_fill() -> None:
    if not memory._CAN_SWAP:
        pytest.skip("this torch cannot swap a storage's data pointer")
    flat = torch.empty(BIG)
    view = flat[10:20]  # kept across free and re-allocation, as autograd keeps the views it saved
    kept = memory.FreedBlocks()
    memory.free_storage(flat, kept)
    for value in (1.0, 2.0):
        memory.alloc_storage(flat, kept)
        assert flat.untyped_storage().nbytes() == BIG * 4
        flat.fill_(value)
        assert torch.equal(view, torch.full((10,), value))
        before = _rss_mib()
        memory.free_storage(flat, kept)
        assert flat.untyped_storage().nbytes() == 0
        assert len(kept) == 1  # kept for the next gather of this size
        kept.clear()  # as the runtime does when a pass ends
        assert before - _rss_mib() > 6  # the 8 MiB went back at once
    memory.alloc_storage(flat)
    memory.free_storage(flat)  # without a pool: unmapped at once
    assert flat.untyped_storage().nbytes() == 0 and not kept
    flat.untyped_storage().resize_(BIG * 4)  # freed, it is an ordinary storage again
    flat.fill_(4.0)
    assert torch.equal(view, torch.full((10,), 4.0))


def test_small_blocks_stay_ordinary_allocations() -> None:
    small = torch.empty(1000)
    memory.free_storage(small)
    memory.alloc_storage(small)
    assert small.untyped_storage().resizable()
    assert memory.empty_flat(1000, torch.float32, torch.device("cpu")).untyped_storage().resizable()


def test_large_flat_buffers_are_mappings() -> None:
    t = memory.empty_flat(BIG, torch.float32, torch.device("cpu"))
    assert not t.untyped_storage().resizable()  # frombuffer over a mapping of its own
    t.fill_(3.0)
    assert float(t[-1]) == 3.0


def test_a_freed_block_is_reused_by_the_next_gather_of_its_size() -> None:
    """See [Note: reusing freed blocks]: the next allocation of the same size takes the kept block (no fresh
    pages), one of another size maps fresh memory, at most ``capacity`` blocks are kept, and a pool of
    capacity 0 keeps none."""
    if not memory._CAN_SWAP:
        pytest.skip("this torch cannot swap a storage's data pointer")
    kept = memory.FreedBlocks()
    a, b, other = torch.empty(BIG), torch.empty(BIG), torch.empty(BIG + 1024)
    for t in (a, b, other):
        memory.free_storage(t, kept)
    memory.alloc_storage(a, kept)
    a.fill_(5.0)
    pointer = a.untyped_storage().data_ptr()
    memory.free_storage(a, kept)
    reused = kept.reused
    before = _rss_mib()
    memory.alloc_storage(b, kept)
    assert b.untyped_storage().data_ptr() == pointer and kept.reused == reused + 1
    assert _rss_mib() - before < 1  # no page was touched anew
    b.fill_(6.0)
    memory.alloc_storage(other, kept)  # another size: fresh memory
    assert other.untyped_storage().data_ptr() != pointer and kept.reused == reused + 1
    for t in (b, other, torch.empty(BIG)):
        memory.free_storage(t, kept)
    assert len(kept) == kept.capacity
    kept.clear()
    none_kept = memory.FreedBlocks(capacity=0)
    memory.alloc_storage(a, none_kept)
    memory.free_storage(a, none_kept)
    assert len(none_kept) == 0


_CAST_THEN_SHARD = """
import sys
import torch, torch.nn as nn
import flatshard
if sys.argv[1] == "off":
    sys.modules["flatshard.engine.shard"].memory.trim_heap = lambda: None
def anon():  # smaps_rollup walks the page tables: exact, where status's RssAnon is a lazily summed counter
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024
torch.set_num_threads(1)
model = nn.Sequential(*[nn.Linear(2048, 2048, dtype=torch.bfloat16) for _ in range(12)])  # 96 MiB in the heap
pin = torch.ones(1 << 18)  # a later heap block: free() cannot return the parameters by shrinking the heap's top
before = anon()
flatshard.shard(model, auto_wrap_policy={nn.Linear})
print(anon() - before)
"""


@pytest.mark.slow
def test_shard_returns_the_replaced_parameters_to_the_system() -> None:
    """See [Note: returning the replaced parameters]: parameters in the C heap (as a model cast in place holds
    them); after shard() the process holds about its shards, not the shards plus the freed originals."""
    import subprocess

    # glibc's dynamic mmap threshold decides whether parameters land in the heap, depending on what the process
    # freed before (a model cast in place puts its copies there): fix it above the tensors' size, so they always
    # do, and keep free() from trimming the heap's top.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

    def growth(trim: str) -> float:
        run = subprocess.run(
            [sys.executable, "-c", _CAST_THEN_SHARD, trim],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        return float(run.stdout.split()[-1])

    # One reading of a process's memory can come out tens of MiB off (seen once in a few runs): the best of
    # three runs of each case is compared, with the same bounds.
    untrimmed, trimmed = max(growth("off") for _ in range(3)), min(growth("on") for _ in range(3))
    assert untrimmed > 80, untrimmed  # the scenario: without trimming the 96 MiB of originals stay
    assert trimmed < 40, trimmed
