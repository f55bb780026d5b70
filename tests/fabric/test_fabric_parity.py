"""Fabric(strategy="flatshard"): training parity with an unsharded reference, clipping, save and load."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard  # registers the strategy names
from flatshard import FlatShardFabricStrategy, MixedPrecision
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _refuses_absent_entry(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """A strict load asking for an entry the checkpoint lacks fails before anything changes."""
    model, optimizer = state["model"], state["optimizer"].optimizer
    before = flatshard.get_state_dict(model, optimizer, rank0_only=False)
    with pytest.raises(KeyError, match="absent"):
        fabric.load(path, {**state, "absent": 1})
    after = flatshard.get_state_dict(model, optimizer, rank0_only=False)
    for k, v in before[0].items():
        assert torch.equal(after[0][k], v), k
    assert after[1]["state"].keys() == before[1]["state"].keys() and state["step"] == 0


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
    _refuses_absent_entry(fabric, path, state)
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


def _run_mixed(rank: int, world: int, reduce_fp32: bool) -> dict[str, object]:
    """bf16-mixed: autocast over bf16 gathered weights, against an emulation that runs a bf16 copy of the
    fp32 reference under the same autocast for each rank's slice and averages its gradients: in bf16 as the
    flag implies (part of the average divided first, the sum in rank order, the rest in fp32), or in fp32 with
    ``MixedPrecision(reduce_dtype=torch.float32)``."""
    from flatshard.engine.precision import reduce_divisors

    strategy = FlatShardFabricStrategy(
        mixed_precision=MixedPrecision(reduce_dtype=torch.float32) if reduce_fp32 else None
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyGPT()
    model = fabric.setup_module(copy.deepcopy(reference))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst_loss = 0.0
    for step in range(3):
        idx, tgt = make_batch(step, 2 * world)
        grads: list[torch.Tensor] | None = None
        for r in range(world):
            low = copy.deepcopy(reference).to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                logits = low(idx[2 * r : 2 * r + 2]).float()  # Fabric's convert_output returns fp32
            ref_loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), tgt[2 * r : 2 * r + 2].flatten()
            )
            ref_loss.backward()
            if r == rank:
                mine_ref = ref_loss.item()
            pre, post = reduce_divisors(world, torch.bfloat16)
            g = [p.grad.float() if reduce_fp32 else p.grad / pre for p in low.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        assert grads is not None
        for p, g in zip(reference.parameters(), grads):
            p.grad = g / world if reduce_fp32 else g.float() / post
        ref_opt.step()
        ref_opt.zero_grad()
        logits = model(idx[2 * rank : 2 * rank + 2])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[2 * rank : 2 * rank + 2].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        worst_loss = max(worst_loss, abs(loss.item() - mine_ref))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    weights = max(
        (full[k] - v).abs().max().item() for k, v in reference.state_dict().items() if v.is_floating_point()
    )
    dtypes = sorted({str(v.dtype) for v in full.values() if v.is_floating_point()})
    return {"loss": worst_loss, "weights": weights, "dtypes": dtypes}


def _run_fp16_scaler(rank: int, world: int) -> str:
    from lightning.fabric.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    fabric = Fabric(accelerator="cpu", devices=world, strategy="flatshard", plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    idx, tgt = make_batch(0, 2 * world)
    loss = torch.nn.functional.cross_entropy(
        model(idx[2 * rank : 2 * rank + 2]).float().flatten(0, 1), tgt[2 * rank : 2 * rank + 2].flatten()
    )
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    return type(fabric.strategy.precision.scaler).__name__  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduce_fp32", [False, True], ids=["bf16_reduce", "fp32_reduce"])
def test_fabric_mixed_precision(reduce_fp32: bool) -> None:
    for r in spawn(_run_mixed, 2, reduce_fp32):
        assert r["loss"] <= 1e-6 and r["weights"] <= 1e-6, r
        assert r["dtypes"] == ["torch.float32"]
    if not reduce_fp32:
        assert spawn(_run_fp16_scaler, 2) == ["FlatShardGradScaler"] * 2


class _WithMetric(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyGPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)


def _run_bf16_true(rank: int, world: int) -> dict[str, str]:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="flatshard", precision="bf16-true")
    fabric.launch()
    torch.manual_seed(0)
    from torchmetrics import MeanMetric

    with fabric.init_module(empty_init=True):
        module = _WithMetric()
        module.mean = MeanMetric()  # built on meta: refused with a clear error
    try:
        fabric.setup_module(module)
        refused = "no"
    except ValueError as err:
        refused = "yes" if "created on the meta device" in str(err) else str(err)
    with fabric.init_module(empty_init=True):
        module = _WithMetric()
    module.mean = MeanMetric()  # metrics are created outside the empty-init context
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    idx, tgt = make_batch(0, 2 * world)
    logits = model(idx[2 * rank : 2 * rank + 2])
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), tgt[2 * rank : 2 * rank + 2].flatten()
    )
    fabric.backward(loss)
    optimizer.step()
    module.mean.update(loss.detach())
    return {
        "params": str(next(module.net.parameters()).dtype),
        "metric": str(module.mean.mean_value.dtype),
        "meta_left": str(any(p.is_meta for p in module.parameters())),
        "refused": refused,
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_bf16_true_with_empty_init_keeps_metrics_fp32() -> None:
    for r in spawn(_run_bf16_true, 2):
        assert r == {
            "params": "torch.bfloat16",
            "metric": "torch.float32",
            "meta_left": "False",
            "refused": "yes",
        }, r


def _sharded_save(rank: int, world: int, tmp: str) -> None:
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=flatshard.FlatShardFabricStrategy(state_dict_type="sharded"),
    )
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    idx, tgt = make_batch(0, 2 * world)
    fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
    optimizer.step()
    scheduler.step()  # the scheduler is state of its own, not a second optimizer (it has .optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 7}
    fabric.save(Path(tmp) / "sharded", state)
    full, optim = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
    if rank == 0:
        torch.save({"model": full, "optim": optim}, Path(tmp) / "expected.pt")
    try:
        fabric.save(Path(tmp) / "filtered", {"model": model}, filter={"model": lambda k, v: True})
    except ValueError as err:
        assert "filter" in str(err)
    else:
        raise AssertionError("filter with a sharded save must be refused")


def _sharded_load(rank: int, world: int, tmp: str) -> dict[str, float]:
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=flatshard.FlatShardFabricStrategy(state_dict_type="sharded"),
    )
    fabric.launch()
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    _refuses_absent_entry(fabric, Path(tmp) / "sharded", state)
    rest = fabric.load(Path(tmp) / "sharded", state)
    scheduler.step()  # continues from the saved schedule: 1e-2 * 0.5 ** 2
    expected = torch.load(Path(tmp) / "expected.pt")
    full, optim = flatshard.get_state_dict(model, optimizer.optimizer, rank0_only=False)
    return {
        "weights": max((full[k] - v).abs().max().item() for k, v in expected["model"].items()),
        "optim": max(
            (optim["state"][i]["exp_avg"] - s["exp_avg"]).abs().max().item()
            for i, s in expected["optim"]["state"].items()
        ),
        "step": float(state["step"]),
        "rest": float(len(rest)),
        "lr": optimizer.param_groups[0]["lr"],
        "scheduler_epoch": float(scheduler.last_epoch),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_sharded_checkpoint_resumes_on_another_world_size(tmp_path: Path) -> None:
    spawn(_sharded_save, 2, str(tmp_path))
    assert (tmp_path / "sharded").is_dir()
    for r in spawn(_sharded_load, 3, str(tmp_path)):
        assert r == {
            "weights": 0.0,
            "optim": 0.0,
            "step": 7.0,
            "rest": 0.0,
            "lr": pytest.approx(2.5e-3),
            "scheduler_epoch": 2.0,
        }, r


def _train_beside_reference(
    fabric: Fabric, model: Any, optimizer: Any, reference: TinyGPT, ref_opt: Any, steps: int
) -> dict[str, torch.Tensor]:
    """``steps`` steps of the set-up model (a slice of the batch per rank) and of the one-process reference on
    the whole batch; the model's full state afterwards."""
    rank, world = fabric.global_rank, fabric.world_size
    for step in range(steps):
        idx, tgt = make_batch(step, 2 * world)
        reference.loss(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
        optimizer.step()
        optimizer.zero_grad()
    return flatshard.get_state_dict(model, rank0_only=False)[0]


def _run_empty_init_joint_setup(rank: int, world: int, tmp: str) -> dict[str, float]:
    """A model built on the meta device and an optimizer created over it, set up together: the optimizer
    must train the materialized parameters (it is pointed at them by name)."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy="flatshard")
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyGPT()
    if rank == 0:
        torch.save({"model": reference.state_dict()}, Path(tmp) / "init.ckpt")
    fabric.barrier()
    with fabric.init_module(empty_init=True):
        model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.load(Path(tmp) / "init.ckpt", {"model": model})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    full = _train_beside_reference(fabric, model, optimizer, reference, ref_opt, steps=2)
    return {
        "weights": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
        "meta_in_optimizer": float(any(p.is_meta for g in optimizer.param_groups for p in g["params"])),
        "optimizer_states": float(len(optimizer.optimizer.state)),
        "expected_states": float(len(ref_opt.state)),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_empty_init_with_optimizer_set_up_jointly(tmp_path: Path) -> None:
    for r in spawn(_run_empty_init_joint_setup, 2, str(tmp_path)):
        assert r["weights"] < 1e-5 and r["meta_in_optimizer"] == 0.0, r
        assert r["optimizer_states"] == r["expected_states"] > 0, r


def _run_adagrad_joint_setup(rank: int, world: int) -> float:
    """Adagrad creates full-shaped state in its constructor; set up jointly it is cut to each rank's piece."""
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block})
    )
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    full = _train_beside_reference(fabric, model, optimizer, reference, ref_opt, steps=2)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_optimizer_with_constructor_state_set_up_jointly() -> None:
    assert max(spawn(_run_adagrad_joint_setup, 2)) < 1e-5
