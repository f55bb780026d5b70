"""Parity: training on N gloo ranks equals single-process training with the same global batch.

Each spawned run loops over every sharding strategy x wrap mode x model inside the ranks (one process
start per world size keeps the tier fast), comparing against an unsharded reference that every rank
trains itself on the whole global batch.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.transport import memory
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
WRAPS = ["none", "class", "size", "manual"]
MODELS = ["tied", "untied"]
STEPS = 4
PER_RANK = 2


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """Per-name weight-decay groups (the way users write them for sharded models)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (
            no_decay if name.endswith("bias") or ".ln" in name or "ln_f" in name or "wpe" in name else decay
        ).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


# (backward_prefetch, forward_prefetch, limit_all_gathers)
PREFETCH = {
    "default": ("BACKWARD_PRE", False, True),
    "post+fwd": ("BACKWARD_POST", True, True),
    "none+nolimit": (None, False, False),
}


def _shard(model: TinyGPT, strategy: str, wrap: str, prefetch: str = "default") -> None:
    backward, forward, limit = PREFETCH[prefetch]
    kwargs = {
        "sharding_strategy": strategy,
        "backward_prefetch": backward,
        "forward_prefetch": forward,
        "limit_all_gathers": limit,
    }
    if wrap == "manual":
        for blk in model.blocks:
            flatshard.shard(blk, **kwargs)
        flatshard.shard(model, **kwargs)
        return
    policy = {"none": None, "class": {Block}, "size": 700}[wrap]
    flatshard.shard(model, auto_wrap_policy=policy, **kwargs)


def _run_case(
    rank: int, world: int, strategy: str, wrap: str, model_kind: str, prefetch: str = "default"
) -> tuple[float, float]:
    torch.manual_seed(0)
    reference = TinyGPT(tie=model_kind == "tied")
    model = copy.deepcopy(reference)
    _shard(model, strategy, wrap, prefetch)
    ref_opt = torch.optim.AdamW(_param_groups(reference), lr=1e-2)
    opt = torch.optim.AdamW(_param_groups(model), lr=1e-2)
    worst_loss = 0.0
    for step in range(STEPS):
        idx, tgt = make_batch(step, PER_RANK * world)
        ref_loss = reference.loss(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model.loss(idx[mine], tgt[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        worst_loss = max(worst_loss, abs(mean_loss.item() / world - ref_loss.item()))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
    worst_weight = max(
        (full[k] - expected[k]).abs().max().item() for k in expected if expected[k].is_floating_point()
    )
    return worst_loss, worst_weight


def _run_all(rank: int, world: int, mapped: bool) -> dict[str, tuple[float, float]]:
    if mapped:  # every CPU block a mapping of its own, as for units of 4 MiB and more
        memory._MIN_BYTES = 1
    results = {}
    for strategy, wrap, model_kind in itertools.product(STRATEGIES, WRAPS, MODELS):
        results[f"{strategy}/{wrap}/{model_kind}"] = _run_case(rank, world, strategy, wrap, model_kind)
    # Every prefetch / rate-limiter combination, on the layouts where prefetching has work to do.
    for strategy, wrap, prefetch in itertools.product(STRATEGIES[:2], ["class", "manual"], PREFETCH):
        if prefetch != "default":
            key = f"{strategy}/{wrap}/tied/{prefetch}"
            results[key] = _run_case(rank, world, strategy, wrap, "tied", prefetch)
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("world_size", "mapped"),
    [
        pytest.param(1, False, marks=pytest.mark.slow),
        (2, False),
        pytest.param(3, False, marks=pytest.mark.slow),
        pytest.param(4, False, marks=pytest.mark.slow),
        pytest.param(3, True, marks=pytest.mark.slow),
    ],
)
def test_parity_every_strategy_and_wrap(world_size: int, mapped: bool) -> None:
    per_rank = spawn(_run_all, world_size, mapped)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(STRATEGIES) * len(WRAPS) * len(MODELS) + 2 * 2 * (len(PREFETCH) - 1)
        for case, (loss_err, weight_err) in results.items():
            assert loss_err < 1e-5, f"rank {rank} {case}: loss differs by {loss_err}"
            assert weight_err < 1e-5, f"rank {rank} {case}: weights differ by {weight_err}"
