"""``flatshard estimate --activation-offload``: the units' saved activations leave the device for host memory,
two units' stay (see [Note: activation offload]); on a CPU device nothing changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from flatshard.cli import main
from flatshard.estimator import estimate
from flatshard.testing.llama import Llama, LlamaBlock, LlamaConfig

LAYERS = 4


def llama_512() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A small Llama whose blocks save tensors of 1 MiB and more (over the 256 KiB that moves), 512 tokens."""
    cfg = LlamaConfig(dim=256, n_layers=LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=688, vocab=1000)
    tokens = torch.zeros(2, 512, dtype=torch.long)
    return Llama(cfg), (tokens, tokens)


def test_offload_moves_all_but_two_units_to_host() -> None:
    plain = estimate(llama_512, 2, auto_wrap_policy={LlamaBlock}).rows[0]
    moved = estimate(llama_512, 2, auto_wrap_policy={LlamaBlock}, activation_offload=True).rows[0]
    assert plain.activations and moved.activations and plain.activations_host == 0
    saved = plain.activations - moved.activations
    # the blocks are alike: all but two of them leave the device; each block's share is what moved / LAYERS
    assert saved > 0 and moved.activations_host > saved
    assert saved == pytest.approx(moved.activations_host * (LAYERS - 2) / LAYERS, rel=0.01)
    assert plain.peak - moved.peak == saved
    assert moved.host == moved.activations_host  # no CPU offload of the state
    assert any("activation offload" in n for n in moved.notes)
    # activation checkpointing: the blocks' inputs are what moves
    both = estimate(
        llama_512,
        2,
        auto_wrap_policy={LlamaBlock},
        activation_checkpointing_policy={LlamaBlock},
        activation_offload=True,
    ).rows[0]
    assert both.activations_host == LAYERS * 2 * 512 * 256 * 4  # one hidden state per block


def test_offload_changes_nothing_on_a_cpu_device() -> None:
    kwargs = {"auto_wrap_policy": {LlamaBlock}, "device": "cpu", "overhead": 0}
    plain = estimate(llama_512, 2, **kwargs).rows[0]
    moved = estimate(llama_512, 2, activation_offload=True, **kwargs).rows[0]
    assert moved.activations == plain.activations and moved.activations_host == 0
    assert any("no effect on a CPU device" in n for n in moved.notes)


def test_command_takes_activation_offload(capsys: pytest.CaptureFixture[str]) -> None:
    target = "tests.estimate.test_estimate_activation_offload:llama_512"
    code = main(["estimate", target, "-n", "2", "--wrap", "LlamaBlock", "--activation-offload"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "activations (host)" in out and "note: activation offload" in out
