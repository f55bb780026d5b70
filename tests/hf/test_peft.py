"""Adapters built by the ``peft`` library on a Hugging Face model (tiny random Llama) train through flatshard as
through DDP, on 2 CPU ranks, in the Trainer and in Fabric: the same per-step losses and adapter weights, the
frozen base untouched and never given a ``.grad``, and (Trainer) a checkpoint of the adapters alone, written
by the LightningModule's ``on_save_checkpoint`` as with any strategy, resumes under flatshard and loads into
DDP.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning.lit_common import LossRecorder, load_ckpt, make_trainer

from .hf_common import VOCAB, build_model

pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")

SEQ, STEPS, GLOBAL_BATCH = 12, 3, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _llama(base_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """peft on a tiny Llama; on a bf16 base the adapters stay fp32 (peft's ``autocast_adapter_dtype``)."""
    base = build_model("llama").to(base_dtype)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora)
    # LoRA's B starts at zero: give it values, so that the first step's gradients differ between layers
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _loader(world: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randint(3, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=g))
    return DataLoader(data, batch_size=GLOBAL_BATCH // world, shuffle=False)


def _adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


class LitPeft(L.LightningModule):
    def __init__(self, adapters_only: bool = False) -> None:
        super().__init__()
        self.model = _llama()
        self.adapters_only = adapters_only
        self.strict_loading = not adapters_only  # a checkpoint of the adapters lacks the base weights

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.adapters_only:
            checkpoint["state_dict"] = _adapters(checkpoint["state_dict"])


def _strategy(name: str) -> Any:
    import flatshard

    if name == "flatshard_block":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return flatshard.FlatShardStrategy(auto_wrap_policy={LlamaDecoderLayer})
    return name


class _AdaptersAtStart(L.Callback):
    """The adapters as the resumed run starts training: what the checkpoint restored."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import flatshard

        with (
            flatshard.unshard_params(pl_module)
            if flatshard.is_sharded(pl_module)
            else contextlib.nullcontext()
        ):
            self.state = {f"model.{k}": v.clone() for k, v in _adapters(pl_module.model.state_dict()).items()}


def _fit(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for name in ("ddp", "flatshard", "flatshard_block"):
        module, recorder = LitPeft(adapters_only=True), LossRecorder()
        base = {k: v.clone() for k, v in module.model.state_dict().items() if "lora_" not in k}
        trainer = make_trainer(world, _strategy(name), max_epochs=1, callbacks=[recorder])
        trainer.fit(module, _loader(world))
        frozen = [p for p in module.parameters() if not p.requires_grad]
        assert frozen and all(p.grad is None for p in frozen), name
        trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
        result[name] = recorder.losses
        if name == "flatshard":  # the whole model as the user sees it: base unchanged, adapters trained
            import flatshard

            with flatshard.unshard_params(module):
                state = {k: v.clone() for k, v in module.model.state_dict().items()}
            for key, value in base.items():
                assert torch.equal(state[key], value), key
    # Resume from the adapters-only checkpoint under flatshard (one more epoch), and load it into DDP.
    for name in ("flatshard", "ddp"):
        module, start = LitPeft(adapters_only=True), _AdaptersAtStart()
        trainer = make_trainer(world, _strategy(name), max_epochs=2, callbacks=[start])
        trainer.fit(module, _loader(world), ckpt_path=os.path.join(out, "flatshard.ckpt"))
        result[f"restored-{name}"] = start.state
        assert trainer.global_step == 2 * STEPS
        trainer.save_checkpoint(os.path.join(out, f"resumed-{name}.ckpt"))
    return result


@pytest.mark.timeout(600)
def test_peft_adapters_train_as_under_ddp_and_save_alone(tmp_path: Any) -> None:
    from flatshard.testing import spawn

    losses = spawn(_fit, 2, str(tmp_path))
    for per_rank in losses:
        for name in ("flatshard", "flatshard_block"):  # per-step losses
            torch.testing.assert_close(torch.tensor(per_rank[name]), torch.tensor(per_rank["ddp"]), **TOL)
    ddp = load_ckpt(tmp_path / "ddp.ckpt")["state_dict"]
    assert ddp and all("lora_" in k for k in ddp), sorted(ddp)  # on_save_checkpoint kept the adapters alone
    initial = _adapters(_llama().state_dict())
    for name in ("flatshard", "flatshard_block"):
        ours = load_ckpt(tmp_path / f"{name}.ckpt")["state_dict"]
        assert sorted(ours) == sorted(ddp), name
        for key, expected in ddp.items():
            assert not torch.equal(expected, initial[key.removeprefix("model.")]), key  # it trained
            torch.testing.assert_close(
                ours[key], expected, **TOL, msg=lambda m, key=key, name=name: f"{name} {key}: {m}"
            )
    saved = load_ckpt(tmp_path / "flatshard.ckpt")["state_dict"]
    for name in ("flatshard", "ddp"):  # the adapters-only checkpoint was loaded, not skipped
        restored = losses[0][f"restored-{name}"]
        assert sorted(restored) == sorted(saved), name
        for key, expected in saved.items():
            torch.testing.assert_close(restored[key], expected, **TOL)
    resumed = {n: load_ckpt(tmp_path / f"resumed-{n}.ckpt") for n in ("flatshard", "ddp")}
    assert resumed["flatshard"]["global_step"] == resumed["ddp"]["global_step"] == 2 * STEPS
    for key, expected in resumed["ddp"]["state_dict"].items():
        torch.testing.assert_close(resumed["flatshard"]["state_dict"][key], expected, **TOL)


def _fabric_fit(world: int, strategy: str, path: str, base_dtype: torch.dtype = torch.float32) -> list[float]:
    """Train the adapters in Fabric for one epoch, save ``{"model": model}`` to ``path``; the mean losses."""
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = _llama(base_dtype)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for (batch,) in fabric.setup_dataloaders(_loader(world)):
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach().float(), reduce_op="mean").item())
    fabric.save(path, {"model": model})
    return losses


def _fabric(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        name: {"losses": _fabric_fit(world, name, os.path.join(out_dir, f"fabric-{name}.ckpt"))}
        for name in ("ddp", "flatshard")
    }


@pytest.mark.timeout(600)
def test_peft_adapters_train_as_under_ddp_in_fabric(tmp_path: Any) -> None:
    from flatshard.testing import spawn

    results = spawn(_fabric, 2, str(tmp_path))
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["flatshard"]["losses"]), torch.tensor(r["ddp"]["losses"]), **TOL
        )
    ddp = _adapters(load_ckpt(tmp_path / "fabric-ddp.ckpt")["model"])
    ours = _adapters(load_ckpt(tmp_path / "fabric-flatshard.ckpt")["model"])
    assert ddp and sorted(ours) == sorted(ddp)
    for key, expected in ddp.items():
        torch.testing.assert_close(ours[key], expected, **TOL, msg=lambda m, key=key: f"{key}: {m}")


class LitBf16Base(LitPeft):
    def __init__(self) -> None:
        super().__init__()
        self.model = _llama(torch.bfloat16)


def _fit_bf16_base(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for name in ("ddp", "flatshard_block"):
        module, recorder = LitBf16Base(), LossRecorder()
        trainer = make_trainer(world, _strategy(name), max_epochs=1, callbacks=[recorder])
        trainer.fit(module, _loader(world))
        trainer.save_checkpoint(os.path.join(out, f"bf16-{name}.ckpt"))
        result[name] = recorder.losses
    for name in ("ddp", "flatshard"):
        path = os.path.join(out, f"bf16-fabric-{name}.ckpt")
        result[f"fabric-{name}"] = _fabric_fit(world, name, path, torch.bfloat16)
    return result


@pytest.mark.timeout(600)
def test_peft_adapters_on_a_bf16_base_share_its_units(tmp_path: Any) -> None:
    """A bf16 base under fp32 adapters in the same decoder-layer units (see [Note: a unit of several dtypes]):
    trains as under DDP in the Trainer and in Fabric, and the full checkpoint keeps each tensor's dtype."""
    from flatshard.testing import spawn

    results = spawn(_fit_bf16_base, 2, str(tmp_path))
    for r in results:
        for ours, ddp in (("flatshard_block", "ddp"), ("fabric-flatshard", "fabric-ddp")):
            torch.testing.assert_close(torch.tensor(r[ours]), torch.tensor(r[ddp]), atol=1e-4, rtol=1e-4)
    for ours, ddp, key in (
        ("bf16-flatshard_block", "bf16-ddp", "state_dict"),
        ("bf16-fabric-flatshard", "bf16-fabric-ddp", "model"),
    ):
        mine, theirs = load_ckpt(tmp_path / f"{ours}.ckpt")[key], load_ckpt(tmp_path / f"{ddp}.ckpt")[key]
        assert sorted(mine) == sorted(theirs) and len(mine) > len(_adapters(mine))  # the whole model
        for name, expected in theirs.items():
            assert mine[name].dtype == expected.dtype, name  # bf16 base, fp32 adapters
            assert expected.dtype == (torch.float32 if "lora_" in name else torch.bfloat16), name
            torch.testing.assert_close(
                mine[name], expected, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
