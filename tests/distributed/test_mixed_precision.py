"""Mixed precision on 2 gloo ranks against an unsharded emulation of the same dtype rule.

The reference keeps fp32 master weights; for each rank's slice of the global batch it runs a bf16 copy
of the model, casts that copy's gradients to the reduce dtype, averages over the slices and steps the
fp32 master. That is exactly what the sharded run computes, so parity is tight.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flatshard
from flatshard.engine.transport import comm
from flatshard.lightning.precision import FlatShardGradScaler
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
STEPS = 3
BF16 = torch.bfloat16


class BNNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear, with a float buffer that buffer_dtype casts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.fc2 = nn.Linear(10, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x))
        self.seen.append(self.bn.weight.dtype)
        return self.fc2(F.relu(h)) * self.scale

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x).float(), y)


def _bn_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _emulate_step(
    reference: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    world: int,
    reduce_dtype: torch.dtype,
    lowering: Callable[[nn.Module], nn.Module],
) -> tuple[list[float], list[torch.Tensor | None]]:
    """Per-rank low-precision losses and the averaged gradients the sharded run should produce."""
    losses: list[float] = []
    total: list[torch.Tensor | None] | None = None
    for r in range(world):
        low = lowering(copy.deepcopy(reference))
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        loss = low.loss(batch[0][mine], batch[1][mine])  # type: ignore[operator]
        loss.backward()
        losses.append(loss.item())
        pre = 2.0 if reduce_dtype == BF16 else 1.0  # flatshard's pre-divide for 16-bit reductions on 2 ranks
        grads = [p.grad.to(reduce_dtype) / pre if p.grad is not None else None for p in low.parameters()]
        total = grads if total is None else [a + b if a is not None else None for a, b in zip(total, grads)]
    assert total is not None
    post = world / (2.0 if reduce_dtype == BF16 else 1.0)
    return losses, [g / post if g is not None else None for g in total]


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    with flatshard.unshard_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _gpt_cases(rank: int, world: int) -> dict[str, float]:
    worst: dict[str, float] = {}
    mp = flatshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    gathered: dict[str, int] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for wrap in (None, {Block}):
            for precision in (mp, None):
                torch.manual_seed(0)
                reference = TinyGPT()
                model = copy.deepcopy(reference)
                flatshard.shard(
                    model, sharding_strategy=strategy, auto_wrap_policy=wrap, mixed_precision=precision
                )
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
                comm.comm_stats.clear()
                case = f"{strategy}/{'blocks' if wrap else 'root'}/{'bf16' if precision else 'fp32'}"
                for step in range(STEPS):
                    batch = make_batch(step, PER_RANK * world)
                    if precision is not None:
                        losses, grads = _emulate_step(
                            reference, batch, world, torch.float32, lambda m: m.to(BF16)
                        )
                        for p, g in zip(reference.parameters(), grads):
                            p.grad = g
                        ref_opt.step()
                        ref_opt.zero_grad()
                    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                    loss = model.loss(batch[0][mine], batch[1][mine])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if precision is not None:
                        assert loss.dtype == torch.float32 or loss.dtype == BF16
                        worst[case + "/loss"] = max(
                            worst.get(case + "/loss", 0.0), abs(loss.item() - losses[rank])
                        )
                gathered[case] = comm.comm_stats["all_gather"]
                if precision is not None:
                    assert all(p.dtype == torch.float32 for p in model.parameters()), "shards must stay fp32"
                    state = flatshard.get_state_dict(model, rank0_only=False)[0]
                    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "steps")
                    worst[case] = max(
                        (a - b).abs().max().item()
                        for a, b in zip(_full_params(model), reference.parameters())
                    )
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for wrap in ("root", "blocks"):
            half, full = gathered[f"{strategy}/{wrap}/bf16"], gathered[f"{strategy}/{wrap}/fp32"]
            assert full > 0 and half * 2 == full, (strategy, wrap, half, full)
    return worst


def _low_precision_grads(rank: int, world: int) -> float:
    """reduce_dtype=bf16 with keep_low_precision_grads: gradient shards stay bf16; SGD steps with them."""
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    mp = flatshard.MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)
    flatshard.shard(model, auto_wrap_policy={Block}, mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = make_batch(step, PER_RANK * world)
        _, grads = _emulate_step(reference, batch, world, BF16, lambda m: m.to(BF16))
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.float() if g is not None else None  # bf16 values, exactly
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model.loss(batch[0][mine], batch[1][mine]).backward()
        assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {BF16}
        opt.step()
        opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(_full_params(model), reference.parameters()))


def _batch_norm(rank: int, world: int, tmp: str) -> float:
    """Batch norm keeps fp32 parameters inside a bf16 unit; buffer_dtype casts only the other buffers,
    and state dicts return buffers in their original dtype."""
    torch.manual_seed(0)
    reference = BNNet()
    model = copy.deepcopy(reference)
    mp = flatshard.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)
    flatshard.shard(model, mixed_precision=mp)
    assert model.scale.dtype == BF16 and model.bn.running_mean.dtype == torch.float32
    assert flatshard.is_sharded(model.bn), "batch norm must be a full-precision unit of its own"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def lower(m: nn.Module) -> nn.Module:
        m.fc1.to(BF16), m.fc2.to(BF16)
        m.scale = m.scale.to(BF16)

        def up(_: nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
            return (args[0].float(),)

        m.bn.register_forward_pre_hook(up)
        m.register_forward_pre_hook(lambda _m, args: tuple(t.to(BF16) for t in args))  # cast_forward_inputs
        m.bn.register_forward_hook(lambda _m, _a, out: out.to(BF16))
        return m

    worst_loss = 0.0
    for step in range(STEPS):
        x, y = _bn_batch(step, PER_RANK * world)
        losses, grads = _emulate_step(reference, (x, y), world, torch.float32, lower)
        for p, g in zip(reference.parameters(), grads):
            p.grad = g
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model.loss(x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        worst_loss = max(worst_loss, abs(loss.item() - losses[rank]))
    assert set(model.seen) == {torch.float32}
    full = flatshard.get_state_dict(model, rank0_only=False)[0]
    assert full["scale"].dtype == torch.float32 and torch.equal(full["scale"], torch.full((3,), 0.5))
    sharded = flatshard.engine.state.sharded.sharded_model_state_dict(model)
    assert sharded["scale"].dtype == torch.float32
    # Both checkpoint kinds hold fp32 and load back into a bf16-buffer model (buffers cast on load).
    for kind in ("full", "sharded"):
        path = os.path.join(tmp, f"bn_{kind}" + (".ckpt" if kind == "full" else ""))
        flatshard.save_checkpoint(path, model, opt, state_dict_type=kind)
        fresh = BNNet()
        flatshard.shard(fresh, mixed_precision=mp)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        flatshard.load_checkpoint(path, fresh, fresh_opt)
        assert fresh.scale.dtype == BF16
        again = flatshard.get_state_dict(fresh, rank0_only=False)[0]
        for key, value in full.items():
            if rank and key.startswith("bn.") and "running" in key:
                continue  # running statistics are per rank; a checkpoint holds rank 0's
            assert again[key].dtype == value.dtype and torch.equal(again[key], value), (kind, key)
    worst = max((a - b).abs().max().item() for a, b in zip(_full_params(model), reference.parameters()))
    return max(worst, worst_loss)


def _input_grads(rank: int, world: int) -> None:
    """Floating inputs are cast inside autograd: an input that requires grad gets an fp32 gradient."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    flatshard.shard(lin, mixed_precision=flatshard.MixedPrecision(param_dtype=BF16))
    x = torch.randn(3, 4, requires_grad=True)
    out = lin(x)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def _scaler(rank: int, world: int) -> tuple[float, bool]:
    """An inf in one rank's gradient shard makes every rank skip the step and back off the scale."""
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, mixed_precision=flatshard.MixedPrecision(param_dtype=torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FlatShardGradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    idx, tgt = make_batch(0, PER_RANK * world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    scaler.scale(model.loss(idx[mine], tgt[mine])).backward()
    if rank == 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # A clean step afterwards does change the weights.
    opt.zero_grad()
    scaler.scale(model.loss(idx[mine], tgt[mine])).backward()
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return scaler.get_scale(), unchanged and changed


def _all_cases(rank: int, world: int, tmp: str) -> dict[str, object]:
    torch.manual_seed(0)
    out: dict[str, object] = {"gpt": _gpt_cases(rank, world)}
    out["low_grads"] = _low_precision_grads(rank, world)
    out["batch_norm"] = _batch_norm(rank, world, tmp)
    _input_grads(rank, world)
    out["scaler"] = _scaler(rank, world)
    dist.barrier()
    return out


def test_mixed_precision_parity_two_ranks(tmp_path: Path) -> None:
    for rank_result in spawn(_all_cases, 2, str(tmp_path)):
        gpt = rank_result["gpt"]
        assert isinstance(gpt, dict)
        for case, diff in gpt.items():
            assert diff <= 1e-6, f"{case}: {diff}"
        assert rank_result["low_grads"] <= 1e-6
        assert rank_result["batch_norm"] <= 1e-6
        assert rank_result["scaler"] == (512.0, True)


def test_mixed_precision_config_errors() -> None:
    with pytest.raises(ValueError, match="floating point"):
        flatshard.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="non-dtype"):
        flatshard.MixedPrecision(param_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown fields"):
        flatshard.shard(nn.Linear(2, 2), mixed_precision={"param_type": "bf16"})
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        flatshard.shard(nn.Linear(2, 2), mixed_precision={"param_dtype": "int8"})
    lin = flatshard.shard(nn.Linear(2, 2), mixed_precision={"param_dtype": "bf16", "reduce_dtype": "float32"})
    assert flatshard.engine.unit_states(lin)[0].handles[0].precision.compute == BF16
