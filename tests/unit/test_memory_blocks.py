"""Large transient CPU blocks: mappings of their own that views (as autograd saves them) keep seeing."""

from __future__ import annotations

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
    memory.free_storage(flat)
    for value in (1.0, 2.0):
        memory.alloc_storage(flat)
        assert flat.untyped_storage().nbytes() == BIG * 4
        flat.fill_(value)
        assert torch.equal(view, torch.full((10,), value))
        before = _rss_mib()
        memory.free_storage(flat)
        assert flat.untyped_storage().nbytes() == 0
        assert before - _rss_mib() > 6  # the 8 MiB went back at once
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
