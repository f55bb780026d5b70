"""Fabric(strategy="flatshard"): training parity with an unsharded reference, clipping, save and load."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

import flatshard  # registers the strategy names
from flatshard.testing import spawn
from flatshard.testing.models import TinyGPT, make_batch


def _run(rank: int, world: int, tmp: str) -> dict[str, float]:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="flatshard")
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created before setup: allowed
    model, optimizer = fabric.setup(model, optimizer)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        idx, tgt = make_batch(step, 2 * world)
        ref_loss = reference.loss(idx, tgt)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(idx[2 * rank : 2 * rank + 2]).flatten(0, 1), tgt[2 * rank : 2 * rank + 2].flatten()
        )
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    path = Path(tmp) / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    saved = torch.load(path, weights_only=False)
    out = {
        "weights": max(
            (saved["model"][k] - v).abs().max().item()
            for k, v in reference.state_dict().items()
            if v.is_floating_point()
        ),
        "optim": max(
            (saved["optimizer"]["state"][i]["exp_avg"] - ref_opt.state_dict()["state"][i]["exp_avg"])
            .abs()
            .max()
            .item()
            for i in ref_opt.state_dict()["state"]
        ),
    }
    # Load into a fresh sharded model + optimizer and check one more identical step.
    fresh = TinyGPT()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = fabric.setup(fresh, fresh_opt)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(path, state)
    idx, tgt = make_batch(3, 2 * world)
    reference.loss(idx, tgt).backward()
    ref_opt.step()
    loss = torch.nn.functional.cross_entropy(
        fresh(idx[2 * rank : 2 * rank + 2]).flatten(0, 1), tgt[2 * rank : 2 * rank + 2].flatten()
    )
    fabric.backward(loss)
    fresh_opt.step()
    full, _ = flatshard.get_state_dict(fresh, rank0_only=False)
    out["resumed"] = max(
        (full[k] - v).abs().max().item() for k, v in reference.state_dict().items() if v.is_floating_point()
    )
    out["step"] = float(state["step"])
    return out


@pytest.mark.timeout(300)
def test_fabric_parity_clip_save_load(tmp_path: Path) -> None:
    for r in spawn(_run, 2, str(tmp_path)):
        assert r["weights"] < 1e-5 and r["optim"] < 1e-5 and r["resumed"] < 1e-5, r
        assert r["step"] == 3.0
