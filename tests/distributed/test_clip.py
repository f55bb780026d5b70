"""clip_grad_norm_ across shards equals torch's clipping on the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _run(rank: int, world: int) -> list[float]:
    errors = []
    for norm_type, strategy in ((2.0, "FULL_SHARD"), (float("inf"), "FULL_SHARD"), (1.5, "NO_SHARD")):
        torch.manual_seed(0)
        reference = TinyGPT()
        model = copy.deepcopy(reference)
        flatshard.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy)
        idx, tgt = make_batch(0, 2 * world)
        reference.loss(idx, tgt).backward()
        model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]).backward()
        ours = flatshard.clip_grad_norm_(model, 0.05, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
        errors.append(abs(ours.item() - theirs.item()))
        opt, ref_opt = (
            torch.optim.SGD(model.parameters(), lr=1.0),
            torch.optim.SGD(reference.parameters(), lr=1.0),
        )
        opt.step()
        ref_opt.step()
        full, _ = flatshard.get_state_dict(model, rank0_only=False)
        errors.append(
            max(
                (full[k] - v).abs().max().item()
                for k, v in reference.state_dict().items()
                if v.is_floating_point()
            )
        )
        model.zero_grad()
        model.loss(idx[:2], tgt[:2]).backward()
        torch.manual_seed(1)
        try:
            for p in model.parameters():
                if p.grad is not None and p.grad.numel():
                    p.grad.view(-1)[0] = float("nan")
            flatshard.clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)
            errors.append(1.0)
        except RuntimeError as err:
            errors.append(0.0 if "non-finite" in str(err) else 1.0)
        if strategy != "NO_SHARD":  # (NO_SHARD gradients are replicas: a NaN is on every rank or none)
            errors += _nan_on_one_rank(model, norm_type, rank, world, idx, tgt)
    return errors


def _nan_on_one_rank(
    model: torch.nn.Module, norm_type: float, rank: int, world: int, idx: torch.Tensor, tgt: torch.Tensor
) -> list[float]:
    """A NaN in the last rank's shard only: every rank sees a NaN norm, and with error_if_nonfinite every
    rank raises before any gradient changes (a MAX reduction alone can drop the NaN)."""
    model.zero_grad()
    model.loss(idx[:2], tgt[:2]).backward()
    if rank == world - 1:
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
        grad.view(-1)[0] = float("nan")
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    try:
        flatshard.clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)
        raised = 1.0
    except RuntimeError as err:
        raised = 0.0 if "non-finite" in str(err) else 1.0
    after = [p.grad for p in model.parameters() if p.grad is not None]
    unchanged = all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(before, after, strict=True)
    )
    norm = flatshard.clip_grad_norm_(model, 1.0, norm_type)
    return [raised, 0.0 if unchanged else 1.0, 0.0 if torch.isnan(norm) else 1.0]


@pytest.mark.timeout(300)
def test_clip_grad_norm_across_shards() -> None:
    for rank, errors in enumerate(spawn(_run, 3)):
        assert max(errors) < 1e-5, (rank, [round(e, 6) for e in errors])
