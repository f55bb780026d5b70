"""The documented recipe: a meta-built Hugging Face model in ``configure_model``, weights loaded once by
``LoadPretrained`` (not again on a resume), against DDP trained from ``from_pretrained``; the same in Fabric,
and a ``peft`` LoRA model whose base is loaded that way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import flatshard
from flatshard.lightning import LoadPretrained
from flatshard.testing import spawn
from tests.lightning.lit_common import make_trainer

from .pretrained_common import BLOCK, VOCAB, llama_config, reference, write_checkpoint

pytestmark = pytest.mark.slow

STEPS = 3
GLOBAL_BATCH = 4


def _loader(world: int) -> DataLoader:
    data = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, 10), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(data), batch_size=GLOBAL_BATCH // world)


class Recipe(L.LightningModule):
    """The guide's recipe: the model is built on the meta device in configure_model, filled by LoadPretrained."""

    def __init__(self, from_path: str | None = None) -> None:
        super().__init__()
        self.from_path = from_path  # the DDP reference loads with from_pretrained instead
        self.model: Any = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.from_path is not None:
            self.model = reference(Path(self.from_path)).train()
            return
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(llama_config())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer_run(rank: int, world: int, ckpt: str, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    ref = Recipe(from_path=ckpt)
    make_trainer(world, "ddp", max_steps=STEPS).fit(ref, _loader(world))
    ref_state = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}

    callback = LoadPretrained(ckpt, prefix="model.")
    model = Recipe()
    strategy = flatshard.FlatShardStrategy(auto_wrap_policy={BLOCK})
    trainer = make_trainer(world, strategy, max_steps=STEPS, callbacks=[callback])
    trainer.fit(model, _loader(world))
    loaded_first = callback.result is not None
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    diff = max(float((full["model." + k] - v).abs().max()) for k, v in ref_state.items())
    path = Path(out) / "last.ckpt"
    trainer.save_checkpoint(path)
    # Resume: the weights come from the checkpoint, the pretrained ones are not read again.
    again = LoadPretrained(ckpt, prefix="model.")
    resumed = Recipe()
    strategy = flatshard.FlatShardStrategy(auto_wrap_policy={BLOCK})
    trainer = make_trainer(world, strategy, max_steps=STEPS + 1, callbacks=[again])
    trainer.fit(resumed, _loader(world), ckpt_path=path)
    return {
        "loaded_first": loaded_first,
        "loaded_on_resume": again.result is not None,
        "weight_diff": diff,
        "losses": model.losses,
        "ref_losses": ref.losses,
        "resumed_steps": len(resumed.losses),
    }


@pytest.mark.timeout(600)
def test_trainer_recipe_matches_ddp_from_pretrained(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "hf", max_shard_size="20KB")
    for r in spawn(_trainer_run, 2, str(ckpt), str(tmp_path)):
        assert r["loaded_first"] and not r["loaded_on_resume"], r
        assert r["weight_diff"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), r
        assert r["resumed_steps"] == 1, r


def _fabric_run(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    fabric = L.Fabric(
        accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy(auto_wrap_policy={BLOCK})
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(llama_config())
    model = fabric.setup_module(model)
    flatshard.load_pretrained(model, ckpt)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for (batch,) in _loader(1):
        mine = batch[rank * (GLOBAL_BATCH // world) : (rank + 1) * (GLOBAL_BATCH // world)]
        loss = model(input_ids=mine, labels=mine).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    ref = reference(Path(ckpt)).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for (batch,) in _loader(1):
        halves = [
            batch[r * (GLOBAL_BATCH // world) : (r + 1) * (GLOBAL_BATCH // world)] for r in range(world)
        ]
        total = sum(ref(input_ids=h, labels=h).loss for h in halves) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(total.detach()))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {"losses": losses, "ref_losses": ref_losses, "diff": diff}


@pytest.mark.timeout(300)
def test_fabric_recipe_matches_reference(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "hf", max_shard_size="20KB")
    for r in spawn(_fabric_run, 2, str(ckpt)):
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), r
        assert r["diff"] < 1e-5, r


def _peft_run(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """A LoRA model over a meta-built base: peft's own init for the adapters (B zero, so the model starts as
    the base), the base loaded by load_pretrained; trained against the same model built by from_pretrained."""
    torch.set_num_threads(1)
    from peft import LoraConfig, get_peft_model

    from .pretrained_common import meta_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(meta_model(), config)
    flatshard.shard(model, auto_wrap_policy={BLOCK})
    result = flatshard.load_pretrained(model, ckpt)
    ref = get_peft_model(reference(Path(ckpt)), LoraConfig(**config.to_dict()))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    b_zero = all(float(v.abs().max()) == 0.0 for k, v in full.items() if "lora_B" in k)
    ref.load_state_dict({k: v for k, v in full.items() if "lora_" in k}, strict=False)  # the same A
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    diffs = []
    for (batch,) in _loader(1):
        mine = batch[rank * per : (rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = sum(ref(input_ids=h, labels=h).loss for h in batch.split(per)) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        diffs.append(abs(float(mean) / world - float(total)))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    weight_diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {
        "b_zero": b_zero,
        "loss_diffs": diffs,
        "weight_diff": weight_diff,
        "lora_not_read": not any("lora_" in n for n in result.loaded) and result.missing == [],
    }


@pytest.mark.timeout(300)
def test_peft_lora_over_a_loaded_base(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "hf", max_shard_size="20KB")
    for r in spawn(_peft_run, 2, str(ckpt)):
        assert r["b_zero"] and r["lora_not_read"], r
        assert max(r["loss_diffs"]) < 1e-5 and r["weight_diff"] < 1e-5, r
