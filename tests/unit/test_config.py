"""Config normalisation: strings, torch's enums, bad values."""

from __future__ import annotations

import pytest
import torch

from flatshard import MixedPrecision, ShardingStrategy
from flatshard.engine.config import (
    BackwardPrefetch,
    normalize_backward_prefetch,
    normalize_mixed_precision,
    normalize_sharding_strategy,
)


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


def test_mixed_precision_flags_must_be_bools() -> None:
    with pytest.raises(TypeError, match=r"keep_low_precision_grads='no'"):
        MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cast_forward_inputs=1"):
        normalize_mixed_precision({"param_dtype": "bf16", "cast_forward_inputs": 1})


def test_torch_mixed_precision_keeps_casting_the_inputs() -> None:
    """torch's default casts the root's inputs (cast_root_forward_inputs=True): never no cast at all."""
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    ours = normalize_mixed_precision(TorchMixedPrecision(param_dtype=torch.bfloat16))
    assert ours == MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    explicit = TorchMixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=False)
    assert normalize_mixed_precision(explicit) == MixedPrecision(
        param_dtype=torch.bfloat16, cast_forward_inputs=False
    )
    with pytest.raises(ValueError, match="_module_classes_to_ignore"):
        normalize_mixed_precision(
            TorchMixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=(torch.nn.LayerNorm,))
        )


def test_shard_options_normalise_every_field_once() -> None:
    from flatshard import ShardOptions
    from flatshard.testing.models import Block

    options = ShardOptions(
        sharding_strategy="shard_grad_op",
        auto_wrap_policy=["flatshard.testing.models.Block"],
        mixed_precision={"param_dtype": "bf16"},
        cpu_offload=_cpu_offload(),
        backward_prefetch="backward_post",
        device="cpu",
    )
    assert options.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert options.auto_wrap_policy is not None and options.auto_wrap_policy(Block(), False, 0)
    assert options.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16)
    assert options.cpu_offload is True
    assert options.backward_prefetch is BackwardPrefetch.BACKWARD_POST
    assert options.device == torch.device("cpu")
    assert ShardOptions() == ShardOptions(sharding_strategy="FULL_SHARD", cpu_offload=None)


def _cpu_offload() -> object:
    from flatshard import CPUOffload

    return CPUOffload(offload_params=True)


def test_shard_options_list_every_bad_field_in_one_error() -> None:
    from flatshard import ShardOptions

    with pytest.raises(ValueError) as info:
        ShardOptions(sharding_strategy="ZERO_4", forward_prefetch="yes", shard_group_size=0, device="gpu:x")
    message = str(info.value)
    assert "4 options are wrong" in message
    for fragment in (
        "sharding_strategy='ZERO_4'",
        "forward_prefetch must be a bool",
        "shard_group_size",
        "device=",
    ):
        assert fragment in message, fragment
    with pytest.raises(TypeError, match="limit_all_gathers must be a bool"):  # one problem keeps its type
        ShardOptions(limit_all_gathers=1)


def test_shard_takes_options_and_keywords_replace_them() -> None:
    from flatshard import ShardOptions, shard
    from flatshard.engine import unit_states
    from flatshard.testing.models import Block, TinyGPT

    options = ShardOptions(auto_wrap_policy={Block}, forward_prefetch=True)
    model = shard(TinyGPT(), options, forward_prefetch=False)
    states = unit_states(model)
    assert len(states) == 1 + len(model.blocks)
    assert all(
        s.options.forward_prefetch is False and s.options.device == torch.device("cpu") for s in states
    )
    with pytest.raises(TypeError, match="unknown options \\['auto_wrap'\\].*auto_wrap_policy"):
        shard(TinyGPT(), auto_wrap={Block})
    with pytest.raises(TypeError, match="ShardOptions"):
        shard(TinyGPT(), {"sharding_strategy": "FULL_SHARD"})  # type: ignore[arg-type]
