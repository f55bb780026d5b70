"""LoRA-style units: large frozen weights and small trainable adapters in one unit keep gradient memory
for the adapters only, and train like the unsharded model (2 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn

D, R = 48, 4


class LoRALinear(nn.Module):
    """A frozen ``d x d`` linear with a rank-``r`` adapter (LoRA's form)."""

    def __init__(self, d: int = D, r: int = R) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, d) * 0.1)
        self.b = nn.Parameter(torch.randn(d, r) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class LoRANet(nn.Module):
    """``n`` adapted linears with GELUs between them."""

    def __init__(self, n: int = 2, d: int = D, r: int = R) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(n):
            layers += [nn.GELU()] if i else []
            layers.append(LoRALinear(d, r))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def _run(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for wrap in (None, {LoRALinear}):
        torch.manual_seed(0)
        reference = LoRANet()
        model = copy.deepcopy(reference)
        flatshard.shard(model, auto_wrap_policy=wrap)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        for step in range(3):
            x, y = _batch(step, 2 * world)
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            mine = slice(2 * rank, 2 * rank + 2)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            kept = sum(
                h._sharded_grad_ref().numel()
                for s in unit_states(model)
                for h in s.handles
                if h._sharded_grad_ref() is not None
            )
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            if step == 2:  # full gradients still read right, then compare with the reference's
                with flatshard.unshard_params(model, with_grads=True):
                    grads = max(
                        (p.grad - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), reference.parameters())
                        if q.requires_grad
                    )
            opt.step()
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=False)
        with flatshard.unshard_params(model):
            weights = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
            )
        name = "blocks" if wrap else "root"
        out[name] = {"weights": weights, "grads": grads, "kept": kept}
    return out


@pytest.mark.timeout(300)
def test_lora_units_keep_gradients_for_trainable_parameters_only() -> None:
    trainable = 2 * (R * D + D * R)
    frozen = 2 * (D * D + D)
    results = spawn(_run, 2)
    for name in ("root", "blocks"):
        for r in results:
            assert r[name]["weights"] <= 1e-5 and r[name]["grads"] <= 1e-5, (name, r)
        kept = sum(r[name]["kept"] for r in results)
        assert kept == trainable, (name, kept, trainable, frozen)  # not trainable + frozen


def _run_toggling(rank: int, world: int) -> dict[str, float]:
    """requires_grad changed between steps, as fine-tuning callbacks do: a frozen base unfrozen at step 2, a
    trainable adapter frozen at step 4; the optimizer holds every parameter from the start."""
    out: dict[str, float] = {}
    for wrap in (None, {LoRALinear}):
        torch.manual_seed(0)
        reference = LoRANet()
        model = copy.deepcopy(reference)
        flatshard.shard(model, auto_wrap_policy=wrap)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(6):
            for net in (model, reference):
                if step == 2:
                    net.layers[0].base.requires_grad_(True)
                if step == 4:
                    net.layers[2].a.requires_grad_(False)
            x, y = _batch(step, 2 * world)
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            mine = slice(2 * rank, 2 * rank + 2)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad), step
            opt.step()
            opt.zero_grad()
        with flatshard.unshard_params(model):
            out["blocks" if wrap else "root"] = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
            )
    return out


@pytest.mark.timeout(300)
def test_requires_grad_changed_while_training_follows_the_flags() -> None:
    for r in spawn(_run_toggling, 3):
        assert r["root"] <= 1e-5 and r["blocks"] <= 1e-5, r
