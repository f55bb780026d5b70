"""Full model + optimizer state: gathered state equals the unsharded reference's, loads across layouts."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2


def _train(model, opt, rank, world, steps, start=0, sharded=True):
    for step in range(start, start + steps):
        idx, tgt = make_batch(step, PER_RANK * world)
        if sharded:
            idx, tgt = (
                idx[rank * PER_RANK : (rank + 1) * PER_RANK],
                tgt[rank * PER_RANK : (rank + 1) * PER_RANK],
            )
        model.loss(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


def _max_diff(a, b):
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (sorted(a, key=str), sorted(b, key=str))
        return max([_max_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max([_max_diff(x, y) for x, y in zip(a, b)] or [0.0])
    assert a == b, (a, b)
    return 0.0


def _run(rank: int, world: int) -> dict[str, float]:
    out = {}
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block})
    ref_opt = torch.optim.AdamW(_groups(reference), lr=1e-2)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _train(reference, ref_opt, rank, world, 2, sharded=False)
    _train(model, opt, rank, world, 2)

    model_state, optim_state = flatshard.get_state_dict(model, opt)
    if rank == 0:
        out["model_vs_reference"] = _max_diff(model_state, reference.state_dict())
        out["optim_vs_reference"] = _max_diff(optim_state, ref_opt.state_dict())
    else:
        out["others_empty"] = float(model_state == {} and optim_state == {})

    # Load the reference's plain state into a model with another wrap policy, keep training: parity.
    other = TinyGPT()
    flatshard.shard(other, auto_wrap_policy=500, sharding_strategy="SHARD_GRAD_OP")
    other_opt = torch.optim.AdamW(_groups(other), lr=1e-2)
    flatshard.set_state_dict(other, other_opt, reference.state_dict(), ref_opt.state_dict())
    _train(reference, ref_opt, rank, world, 2, start=2, sharded=False)
    _train(other, other_opt, rank, world, 2, start=2)
    full, _ = flatshard.get_state_dict(other, rank0_only=False)
    out["resumed_vs_reference"] = _max_diff(full, reference.state_dict())

    # A checkpoint of another model is refused before anything changes.
    before, _ = flatshard.get_state_dict(other, rank0_only=False)
    wrong = TinyGPT(d_model=15).state_dict()
    try:
        flatshard.set_state_dict(other, None, wrong)
        out["mismatch_error"] = 0.0
    except ValueError as err:
        out["mismatch_error"] = float("blocks.0.ln1.weight" in str(err) and "(15,)" in str(err))
    after, _ = flatshard.get_state_dict(other, rank0_only=False)
    out["unchanged_after_error"] = _max_diff(before, after)

    bad_groups = torch.optim.AdamW(other.parameters(), lr=1e-2)
    try:
        flatshard.set_state_dict(other, bad_groups, None, ref_opt.state_dict())
        out["group_error"] = 0.0
    except ValueError as err:
        out["group_error"] = float("param groups" in str(err))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_full_state_gather_and_load(world_size: int) -> None:
    results = spawn(_run, world_size)
    root = results[0]
    assert root["model_vs_reference"] < 1e-5
    assert root["optim_vs_reference"] < 1e-5
    assert all(r["others_empty"] == 1.0 for r in results[1:])
    for rank, r in enumerate(results):
        assert r["resumed_vs_reference"] < 1e-5, (rank, r)
        assert r["mismatch_error"] == 1.0, (rank, r)
        assert r["unchanged_after_error"] == 0.0, (rank, r)
        assert r["group_error"] == 1.0, (rank, r)
