"""Config normalisation: strings, torch's enums, bad values."""

from __future__ import annotations

import pytest
import torch

from flatshard import MixedPrecision, ShardingStrategy
from flatshard.engine.config import BackwardPrefetch, normalize_backward_prefetch, normalize_sharding_strategy


@pytest.mark.parametrize("value", ["FULL_SHARD", "full_shard", ShardingStrategy.FULL_SHARD])
def test_sharding_strategy_forms(value: object) -> None:
    assert normalize_sharding_strategy(value) is ShardingStrategy.FULL_SHARD


def test_torch_fsdp_enum_is_accepted() -> None:
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    assert normalize_sharding_strategy(TorchStrategy.SHARD_GRAD_OP) is ShardingStrategy.SHARD_GRAD_OP


def test_unknown_strategy_lists_choices() -> None:
    with pytest.raises(ValueError, match="FULL_SHARD.*SHARD_GRAD_OP"):
        normalize_sharding_strategy("ZERO_4")
    with pytest.raises(TypeError):
        normalize_sharding_strategy(3)  # type: ignore[arg-type]


def test_backward_prefetch() -> None:
    assert normalize_backward_prefetch(None) is None
    assert normalize_backward_prefetch("backward_pre") is BackwardPrefetch.BACKWARD_PRE


def test_mixed_precision_rejects_non_dtypes() -> None:
    with pytest.raises(TypeError, match="param_dtype='bf16'"):
        MixedPrecision(param_dtype="bf16")  # type: ignore[arg-type]
    assert MixedPrecision(param_dtype=torch.bfloat16).reduce_dtype is None


def test_reshard_after_forward_flags() -> None:
    assert ShardingStrategy.FULL_SHARD.reshard_after_forward
    assert not ShardingStrategy.SHARD_GRAD_OP.reshard_after_forward
