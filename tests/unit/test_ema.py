"""``flatshard.EMA`` on one process: the update formula, swapping in and back exactly, the
consolidated state under the model's names and loading it back, and bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from flatshard.engine import EMA


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def test_update_swap_and_state_roundtrip() -> None:
    model = _model()
    ema = EMA(model, decay=0.5)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = {n: 0.5 * start[n] + 0.5 * trained[n] for n in start}
    with ema.swapped_in():
        for n, p in model.named_parameters():
            assert torch.allclose(p, expected[n])
        with pytest.raises(RuntimeError, match="swapped in"):
            ema.update()
    for n, p in model.named_parameters():  # back exactly
        assert torch.equal(p, trained[n])
    state = ema.full_state_dict()
    assert set(state) == set(model.state_dict())  # parameters and buffers, under the model's names
    other = EMA(copy.deepcopy(model), decay=0.5)
    other.load_full_state_dict(state)
    with other.swapped_in():
        for n, p in other.module.named_parameters():
            assert torch.allclose(p, expected[n])
    for n, p in other.module.named_parameters():
        assert torch.equal(p, trained[n])  # loading the EMA left the live weights alone


@pytest.mark.parametrize("decay", [1.0, -0.1, True, "0.9"])
def test_a_bad_decay_is_refused(decay: object) -> None:
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\)"):
        EMA(_model(), decay=decay)  # type: ignore[arg-type]
