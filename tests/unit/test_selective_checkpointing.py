"""``activation_checkpointing_mode`` in one process: what it accepts and refuses, what each mode keeps, and that
selective checkpointing trains exactly like no checkpointing, dropout included (see [Note: selective
checkpointing])."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

import flatshard
from flatshard.engine import ShardOptions
from flatshard.engine.setup.activation_checkpointing import (
    SELECTIVE_OPS,
    _policy,
    checkpointed_call,
    resolve_checkpointing_mode,
    selective_contexts,
)
from flatshard.testing.activations import held_activation_bytes, saved_activation_bytes
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.dropout_models import DropoutBlock, dropout_gpt

MODES: list[Any] = [None, "full", "selective", ["aten.mm", "aten.addmm"]]


# ------------------------------------------------------------------------------------------ the option's values
def test_modes_and_operator_names_are_normalised() -> None:
    assert resolve_checkpointing_mode("full") == "full"
    assert resolve_checkpointing_mode(" Selective ") == "selective"
    names = ["aten.mm", "torch.ops.aten.addmm", "aten::bmm", "baddbmm", "aten.mm.default", "aten.mm"]
    assert resolve_checkpointing_mode(names) == (
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.mm.default",
    )
    assert resolve_checkpointing_mode((torch.ops.aten.mm, torch.ops.aten.addmm.default)) == (
        "aten.mm",
        "aten.addmm.default",
    )
    options = ShardOptions(activation_checkpointing_policy={Block}, activation_checkpointing_mode=["mm"])
    assert options.activation_checkpointing_mode == ("aten.mm",)
    assert ShardOptions().activation_checkpointing_mode == "full"


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (["aten.mm", "aten.matmull"], ValueError, ["'aten.matmull'", "did you mean aten.matmul", "HINT"]),
        (["aten.mm.bogus"], ValueError, ["'aten.mm.bogus'", "'mm.bogus'"]),
        (["nosuchlib.mm"], ValueError, ["'nosuchlib.mm'", "torch.ops.nosuchlib"]),
        (["a.b.c.d"], ValueError, ["'a.b.c.d'", "not an operator name"]),
        (["aten.mm.out"], ValueError, ["'aten.mm.out'", "writes into an argument", "'aten.mm'"]),
        ([3], TypeError, ["3", "not an operator"]),
        ([], ValueError, ["keeps no operator", "'full'"]),
        ("partial", ValueError, ["'partial'", "'selective'", "'full'"]),
        (2, TypeError, ["int", "'selective'"]),
    ],
)
def test_bad_values_are_refused_naming_them(value: Any, error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as info:
        ShardOptions(activation_checkpointing_policy={Block}, activation_checkpointing_mode=value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_mode_without_a_policy_is_refused_with_a_hint() -> None:
    with pytest.raises(
        ValueError, match="activation_checkpointing_policy is None.*HINT: set activation_check"
    ):
        ShardOptions(activation_checkpointing_mode="selective")
    with pytest.raises(ValueError, match="activation_checkpointing_policy is None"):
        flatshard.shard(TinyGPT(), activation_checkpointing_mode=["aten.mm"])
    ShardOptions(activation_checkpointing_mode="full")  # the default: nothing to say


def test_the_strategies_take_the_mode_and_check_it_when_built() -> None:
    strategy = flatshard.FlatShardStrategy(
        activation_checkpointing_policy={Block}, activation_checkpointing_mode=["aten.mm", "aten.addmm"]
    )
    assert strategy.options.shard.activation_checkpointing_mode == ("aten.mm", "aten.addmm")
    with pytest.raises(ValueError, match="'aten.nope'"):
        flatshard.FlatShardFabricStrategy(
            activation_checkpointing_policy={Block}, activation_checkpointing_mode=["aten.nope"]
        )


def test_selective_keeps_matmuls_attention_and_functional_collectives() -> None:
    for name in (
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._scaled_mm",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "_c10d_functional.reduce_scatter_tensor",
    ):
        assert name in SELECTIVE_OPS
    context_fn = selective_contexts("selective")
    assert context_fn is not None and selective_contexts("full") is None
    assert pickle.loads(pickle.dumps(context_fn)).args == ("selective",)  # a model with it pickles
    assert len(context_fn()) == 2  # torch's two modes: forward, recomputation
    policy: Callable[..., CheckpointPolicy] = _policy("selective")
    aten = torch.ops.aten
    assert policy(None, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert (
        policy(None, aten._scaled_dot_product_flash_attention_for_cpu.default) is CheckpointPolicy.MUST_SAVE
    )
    for cheap in (aten.gelu.default, aten.native_dropout.default, aten.native_layer_norm.default):
        assert policy(None, cheap) is CheckpointPolicy.PREFER_RECOMPUTE
    # out= forms (what compiled kernels call, into buffers they reuse) are never kept
    assert policy(None, aten.mm.out) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.addmm.out) is CheckpointPolicy.PREFER_RECOMPUTE


# ------------------------------------------------------------------------------------------ what each mode keeps
def _held_after_forward(mode: Any, model: nn.Module) -> tuple[int, torch.Tensor]:
    """Bytes of tensor storage the forward left alive for backward (parameters and gathered buffers excepted)."""
    kwargs = (
        {}
        if mode is None
        else {"activation_checkpointing_policy": {Block}, "activation_checkpointing_mode": mode}
    )
    flatshard.shard(model, auto_wrap_policy={Block}, **kwargs)
    idx, tgt = make_batch(0, 8, seq=11)
    model.loss(idx, tgt).backward()  # the first step records the order
    return held_activation_bytes(model, lambda: model.loss(idx, tgt))


def test_saved_activation_bytes_are_ordered_none_selective_full() -> None:
    """Selective keeps the block inputs (as full does) and the matrix products' and attention's outputs; a list of
    two operators keeps less than selective.

    Counted as the storages alive at the end of forward: selective checkpointing keeps its tensors in torch's
    own cache, not through autograd's saved-tensor hooks, which a checkpoint hides from an outer hook anyway.
    """
    torch.manual_seed(0)
    reference = TinyGPT(d_model=64, n_layer=3)
    held = {}
    for mode in MODES:
        held[str(mode)], loss = _held_after_forward(mode, copy.deepcopy(reference))
        loss.backward()
    none, full, selective, listed = (held[str(m)] for m in MODES)
    assert none > selective > listed > full, held
    assert selective < 0.9 * none and full < 0.5 * selective, held


def test_saved_tensor_hooks_do_not_see_what_selective_keeps() -> None:
    """Why the count above is of live storage: an outer ``saved_tensors_hooks`` sees neither what a checkpoint saves
    (its own hooks take those) nor the outputs selective checkpointing keeps, so it counts full and selective
    alike."""
    torch.manual_seed(0)
    reference = TinyGPT(d_model=64, n_layer=3)
    saved = {}
    for mode in ("full", "selective"):
        model = copy.deepcopy(reference)
        flatshard.shard(
            model,
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block},
            activation_checkpointing_mode=mode,
        )
        saved[mode], loss = saved_activation_bytes(model, lambda m=model: m.loss(*make_batch(0, 8, seq=11)))
        loss.backward()
    assert saved["full"] == saved["selective"], saved


# ------------------------------------------------------------------------------------------ same training
def _train(mode: Any, model: nn.Module, steps: int = 3, **options: Any) -> dict[str, Any]:
    kwargs = (
        {}
        if mode is None
        else {"activation_checkpointing_policy": {DropoutBlock}, "activation_checkpointing_mode": mode}
    )
    flatshard.shard(model, auto_wrap_policy={DropoutBlock}, **kwargs, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks for every mode
        loss = model.loss(*make_batch(step, 4))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("mode", ["selective", ("aten.mm", "aten.addmm")], ids=["selective", "ops"])
def test_selective_trains_like_no_checkpointing_with_dropout(mode: Any) -> None:
    torch.manual_seed(0)
    reference = dropout_gpt()
    plain = _train(None, copy.deepcopy(reference))
    ours = _train(mode, copy.deepcopy(reference))
    model = copy.deepcopy(reference)
    _train(mode, model, steps=1)
    assert all(checkpointed_call(b) is not None for b in model.blocks)
    torch.testing.assert_close(ours["losses"], plain["losses"], rtol=0, atol=1e-6)
    for mine, theirs in zip(
        ours["grads"] + [ours["weights"]], plain["grads"] + [plain["weights"]], strict=True
    ):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # dropout really ran: a second forward with another seed gives another loss
    torch.manual_seed(7)
    assert model.loss(*make_batch(0, 4)).item() != ours["losses"][0]
