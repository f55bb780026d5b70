"""A flatshard-trained Hugging Face model leaves the Trainer as a plain HF model.

``trainer.save_checkpoint(path)`` under ``strategy="flatshard"`` writes one consolidated Lightning checkpoint
(rank 0), read here with plain ``torch.load``. Its ``state_dict``, with the LightningModule's ``model.``
prefix stripped, loads with ``load_state_dict(strict=True)`` into a freshly built HF model of the same config
(differently seeded, so the load must overwrite everything); the ties survive the load (one Parameter), the
weights are the DDP-trained model's, and ``save_pretrained`` / ``from_pretrained`` gives back the same
weights, ties and logits. The training runs are ``conftest.trained``'s (one spawn shared with the parity
tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lightning.lit_common import load_ckpt

from .hf_common import (
    WEIGHT_TOL,
    assert_ties,
    build_model,
    checkpoint_name,
    hf_state_dict,
    prompt,
    tie_missing_keys,
    tied_keys,
)

pytestmark = pytest.mark.slow

CASES = [
    ("gpt2", "flatshard"),
    ("gpt2", "flatshard_block"),
    ("t5", "flatshard"),
    ("t5", "flatshard_block"),
    ("resnet", "flatshard"),
]


def _load_strictly(kind: str, path: Path) -> torch.nn.Module:
    """What a user does with a Lightning checkpoint of a LightningModule holding the HF model as ``model``."""
    ckpt = load_ckpt(path)
    model = build_model(kind, seed=1)  # other weights than the trained run started from
    state = tie_missing_keys(model, hf_state_dict(ckpt["state_dict"]))
    model.load_state_dict(state, strict=True)
    return model.eval()


def _inputs(kind: str) -> dict[str, torch.Tensor]:
    if kind == "resnet":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))}
    inputs = prompt(kind)
    if kind == "t5":
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :3]
    return inputs


@torch.no_grad()
def _logits(model: torch.nn.Module, kind: str) -> torch.Tensor:
    return model(**_inputs(kind)).logits


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any], what: str, exact: bool) -> None:
    assert sorted(actual) == sorted(expected), (what, sorted(actual), sorted(expected))
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, (what, key, actual[key].dtype, value.dtype)
        if exact:
            assert torch.equal(actual[key], value), (what, key)
        else:
            torch.testing.assert_close(
                actual[key], value, **WEIGHT_TOL, msg=lambda m, k=key: f"{what}: {k}: {m}"
            )


@pytest.mark.parametrize(("kind", "strategy"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_consolidated_checkpoint_loads_into_hf_model_and_round_trips(
    trained: dict[str, Any], tmp_path: Path, kind: str, strategy: str
) -> None:
    path = trained["dir"] / checkpoint_name(kind, strategy)
    assert path.is_file(), path  # one consolidated file, not a sharded directory
    ckpt = load_ckpt(path)
    assert {"state_dict", "optimizer_states", "global_step"} <= set(ckpt)
    # Like DDP's (and ``model.state_dict()``), the file holds every tied name, each equal to its source.
    state = hf_state_dict(ckpt["state_dict"])
    fresh = build_model(kind)
    assert sorted(state) == sorted(fresh.state_dict())
    for key, source in tied_keys(fresh).items():
        assert torch.equal(state[key], state[source]), (key, source)

    model = _load_strictly(kind, path)
    assert_ties(kind, model)
    reference = _load_strictly(kind, trained["dir"] / checkpoint_name(kind, "ddp"))
    _assert_same_state(model.state_dict(), reference.state_dict(), "flatshard vs ddp", exact=False)
    logits = _logits(model, kind)
    torch.testing.assert_close(logits, _logits(reference, kind), **WEIGHT_TOL)

    model.save_pretrained(tmp_path / "pretrained")
    cls = type(model)
    reloaded = cls.from_pretrained(tmp_path / "pretrained").eval()
    assert_ties(kind, reloaded)
    _assert_same_state(reloaded.state_dict(), model.state_dict(), "from_pretrained", exact=True)
    assert torch.equal(_logits(reloaded, kind), logits)
