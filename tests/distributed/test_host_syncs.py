"""A training step reads nothing back from the device in flatshard's code when every parameter gets a gradient:
no ``tolist``/``item``/``cpu``/``numpy``/``bool`` of a tensor (each a host synchronization on CUDA, which keeps the
CPU from queueing the optimizer step and the next forward), and the gradients equal the unsharded reference's."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextmanager
def _count_reads() -> Iterator[Counter[str]]:
    """Count reads of tensor values made by flatshard's own code (the caller's frame is in the package)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/flatshard/" in caller and "/flatshard/testing/" not in caller:
                counts[f"{name} in {caller.rsplit('/flatshard/', 1)[1]}"] += 1
            return original(self, *args, **kwargs)

        return read

    for name in _READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _step_reads(rank: int, world: int, options: dict) -> dict:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = flatshard.shard(copy.deepcopy(ref), auto_wrap_policy={Block}, **options)
    idx, tgt = make_batch(0, 2 * world)
    model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]).backward()  # first step: setup
    model.zero_grad()
    with _count_reads() as counts:
        loss = model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2])
        loss.backward()
    ref.loss(idx, tgt).backward()
    with flatshard.unshard_params(model, with_grads=True):
        same = all(
            torch.allclose(p.grad, r.grad, atol=1e-5) for p, r in zip(model.parameters(), ref.parameters())
        )
    return {"reads": dict(counts), "same": same}


@pytest.mark.parametrize(
    "options",
    [
        {},
        pytest.param({"sharding_strategy": "SHARD_GRAD_OP"}, marks=pytest.mark.slow),
        pytest.param({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}, marks=pytest.mark.slow),
    ],
    ids=["full_shard", "grad_op", "hybrid"],
)
def test_a_training_step_reads_nothing_back(options: dict) -> None:
    world = 4 if options.get("sharding_strategy") == "HYBRID_SHARD" else 2
    for rank, r in enumerate(spawn(_step_reads, world, options)):
        assert r["reads"] == {}, (rank, r)
        assert r["same"], (rank, r)
