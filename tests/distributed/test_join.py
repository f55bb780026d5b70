"""``flatshard.join``: ranks that run different numbers of forwards (an uneven evaluation split) all finish,
with each rank's outputs equal to the unsharded model's, and meet at the next collective; forwards that diverge
(a unit skipped on one rank) raise on every rank, naming each rank's unit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

COUNTS = (3, 2, 0, 0)  # evaluation batches of ranks 0..3


class SkippingGPT(TinyGPT):
    """A data-dependent branch: the blocks in ``skip`` are not run."""

    skip: frozenset[int] = frozenset()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for i, blk in enumerate(self.blocks):
            if i not in self.skip:
                h = blk(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]


def _uneven(rank: int, world: int, options: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = TinyGPT()
    model = flatshard.shard(copy.deepcopy(ref), auto_wrap_policy={Block}, **options)
    batches = [make_batch(step, 2)[0] for step in range(COUNTS[rank])]
    out: dict = {}
    with torch.no_grad(), flatshard.join(model):
        got = [model(b) for b in batches]
    with torch.no_grad():
        out["outputs"] = all(torch.allclose(g, ref(b), atol=1e-5) for g, b in zip(got, batches))
    count = torch.tensor([len(batches)])
    dist.all_reduce(count)  # the epoch-end reduction every rank reaches together
    out["total"] = int(count)
    # the model still trains normally afterwards
    idx, tgt = make_batch(5, 2 * world)
    model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]).backward()
    out["trains"] = all(p.grad is not None for p in model.parameters())
    # joining again works (a second evaluation epoch), with a rank that runs nothing
    with torch.no_grad(), flatshard.join(model):
        for b in batches[: 1 if rank == world - 1 else 0]:
            model(b)
    out["second_epoch"] = True
    return out


@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, {}),
        pytest.param(
            3, {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": True}, marks=pytest.mark.slow
        ),
        pytest.param(2, {"sharding_strategy": "NO_SHARD"}, marks=pytest.mark.slow),
        pytest.param(4, {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}, marks=pytest.mark.slow),
    ],
    ids=["full_shard", "grad_op_forward_prefetch", "no_shard", "hybrid"],
)
def test_uneven_forwards_complete_with_the_reference_outputs(world: int, options: dict) -> None:
    expected_total = sum(COUNTS[:world])
    for rank, r in enumerate(spawn(_uneven, world, options)):
        assert r["total"] == expected_total, (rank, r)
        assert r["outputs"] and r["trains"] and r["second_epoch"], (rank, r)


def _diverged(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SkippingGPT()
    model.skip = frozenset({1}) if rank == 1 else frozenset()
    flatshard.shard(model, auto_wrap_policy={Block})
    try:
        with torch.no_grad(), flatshard.join(model):
            model(make_batch(0, 2)[0])
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_diverged_forwards_raise_on_every_rank_naming_each_unit() -> None:
    for message in spawn(_diverged, 2):
        assert "forwards diverged" in message, message
        assert "rank 0: unit 2 (blocks.1)" in message and "rank 1: unit 3 (blocks.2)" in message, message
        assert "HINT" in message


def _with_grad(rank: int, world: int) -> str:
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block})
    try:
        with flatshard.join(model):
            model(make_batch(0, 2)[0])
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_forward_with_gradients_inside_join_is_refused() -> None:
    for message in spawn(_with_grad, 2):
        assert "without gradients" in message and "torch.no_grad()" in message, message
