"""MappedPages: pages of a memory-mapped checkpoint file given back after their bytes are read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flatshard.checkpoint.mapped import MappedPages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise")

MIB = 1 << 20


def _rss_file_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_release_gives_back_the_pages_read_and_keeps_the_values(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    big = torch.arange(16 * MIB, dtype=torch.float32)  # 64 MiB
    torch.save({"big": big, "small": torch.ones(3)}, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    pages = MappedPages(path)
    assert pages.ranges, "the file's mapping was not found"
    before = _rss_file_mib()
    expected = float(big.double().sum())
    assert float(loaded["big"].double().sum()) == expected  # faults every page in
    assert _rss_file_mib() > before + 48
    pages.release(loaded["big"])
    assert pages.released >= 64 * MIB
    assert _rss_file_mib() < before + 8
    # A page given back is read again from the file, unchanged.
    assert float(loaded["big"].double().sum()) == expected
    assert torch.equal(loaded["small"], torch.ones(3))


def test_release_touches_nothing_outside_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(1024)}, path)
    torch.load(path, mmap=True, weights_only=True)
    pages = MappedPages(path)
    private = torch.full((4 * MIB,), 7.0)
    pages.release(private)
    assert pages.released == 0
    assert torch.all(private == 7.0)
    nothing = MappedPages(None)  # a file read into memory from a URL
    nothing.release(private)
    assert nothing.ranges == [] and nothing.released == 0


def test_a_slice_releases_only_its_pages_rounded_out(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(4 * MIB, dtype=torch.float32)}, path)  # 16 MiB
    loaded = torch.load(path, mmap=True, weights_only=True)
    pages = MappedPages(path)
    part = loaded["w"][1000 : 1000 + MIB]
    part.sum()
    pages.release(part)
    assert 4 * MIB <= pages.released <= 4 * MIB + 2 * 4096
    assert torch.equal(loaded["w"][:2000], torch.arange(2000, dtype=torch.float32))
