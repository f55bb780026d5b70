"""Hugging Face models trained through the Lightning Trainer on 2 CPU ranks: ``strategy="flatshard"`` (one
root unit, and one unit per transformer block) trains exactly like ``strategy="ddp"``.

GPT-2 ties its input and output embeddings; T5 uses one ``shared`` embedding in the encoder, the decoder
and the tied ``lm_head``; ResNet has BatchNorm running statistics (buffers). Every run fits 3 steps of the
same global batch from the same weights (``conftest.trained``, one spawn for the tier); compared: the synced
per-step losses on each rank, and every weight and buffer of the consolidated checkpoint rank 0 writes.

BatchNorm under DDP: the buffers are broadcast from rank 0 before every forward, and each rank then updates
them with its own batch, so rank 0's buffers (what the checkpoint holds) follow rank 0's batches alone, as
they do under flatshard, where each rank keeps its own buffers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lightning.lit_common import load_ckpt

from .hf_common import TRAIN_STEPS, WEIGHT_TOL, build_model, checkpoint_name, hf_state_dict

pytestmark = pytest.mark.slow

PARITY = [
    ("gpt2", "flatshard"),
    ("gpt2", "flatshard_block"),
    ("t5", "flatshard"),
    ("t5", "flatshard_block"),
    ("resnet", "flatshard"),
]


@pytest.mark.parametrize(("kind", "strategy"), PARITY, ids=[f"{k}-{s}" for k, s in PARITY])
def test_losses_weights_and_buffers_match_ddp(trained: dict[str, Any], kind: str, strategy: str) -> None:
    for rank, per_rank in enumerate(trained["losses"]):
        ours, ddp = per_rank[f"{kind}-{strategy}"], per_rank[f"{kind}-ddp"]
        assert len(ours) == len(ddp) == TRAIN_STEPS, (rank, ours, ddp)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ddp), **WEIGHT_TOL)
    ours_ckpt = load_ckpt(trained["dir"] / checkpoint_name(kind, strategy))
    ddp_ckpt = load_ckpt(trained["dir"] / checkpoint_name(kind, "ddp"))
    assert ours_ckpt["global_step"] == ddp_ckpt["global_step"] == TRAIN_STEPS
    ours_state, ddp_state = hf_state_dict(ours_ckpt["state_dict"]), hf_state_dict(ddp_ckpt["state_dict"])
    assert sorted(ours_state) == sorted(ddp_state)
    initial = build_model(kind).state_dict()
    assert sorted(ddp_state) == sorted(initial)  # every parameter and buffer of the HF model, tied keys too
    for key, value in initial.items():  # training moved every weight (and BatchNorm's statistics)
        assert not torch.equal(ddp_state[key], value), key
    for key, expected in ddp_state.items():
        got = ours_state[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, (key, got.dtype, got.shape)
        if expected.is_floating_point():
            torch.testing.assert_close(got, expected, **WEIGHT_TOL, msg=lambda m, key=key: f"{key}: {m}")
        else:  # num_batches_tracked
            assert torch.equal(got, expected), (key, got, expected)
    if kind == "resnet":
        assert any(k.endswith("running_var") for k in ddp_state)
