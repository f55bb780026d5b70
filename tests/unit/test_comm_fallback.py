"""A backend without ``reduce_scatter`` falls back to all-reduce and slice with one warning that names the
backend and the doubled traffic; any other error of the backend is raised, never taken for "unsupported"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flatshard.engine.transport import comm
from flatshard.engine.transport.groups import state_of


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _refusing(message: str):
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    return refuse


def test_unsupported_reduce_scatter_falls_back_once_with_a_warning(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        comm, "_reduce_scatter_base", _refusing("ProcessGroupGloo does not support reduce_scatter")
    )
    full = torch.arange(6.0)
    out = torch.empty(6)
    with caplog.at_level(logging.WARNING, logger="flatshard"):
        for _ in range(3):
            comm.reduce_scatter_flat(out, full.clone(), None, async_op=False)
    assert torch.equal(out, full)  # one rank: the sum is the input
    warned = [r.getMessage() for r in caplog.records if "has no reduce_scatter" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "'gloo'" in warned[0] and "twice the bytes" in warned[0] and "HINT" in warned[0]


def test_other_backend_errors_are_raised(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        comm, "_reduce_scatter_base", _refusing("Connection reset by peer (support ticket 12)")
    )
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        comm.reduce_scatter_flat(torch.empty(4), torch.ones(4), None, async_op=False)
    assert state_of(None).native_reduce_scatter  # the native path is still used next time
