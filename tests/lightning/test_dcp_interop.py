"""Switching strategies mid-run through sharded checkpoints (see [Note: DCP-native layout]).

Lightning's own ``ModelParallelStrategy`` (torch FSDP2, one ``fully_shard`` per ``Block``) trains the first epoch
on 2 ranks and saves its sharded directory (``state_dict.*`` / ``optimizer_0.*`` entries, ``meta.pt``); the
flatshard Trainer resumes it on 3 ranks and trains the second epoch, and writes a sharded directory of its own
that ``dcp_to_torch_save`` turns into plain tensors. Everything is compared with one device
(``strategy="auto"``) trained for both epochs without interruption: losses of the second epoch, weights, AdamW
state, ``global_step`` and loops. (Lightning's ``FSDPStrategy`` refuses CPU accelerators; its layout is tested
with torch FSDP1 and Lightning's own save and load helpers in ``tests/distributed/test_dcp_interop.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import (
    LitGPT,
    LossRecorder,
    assert_same_optimizer_state,
    assert_same_weights,
    fit_and_save,
    load_ckpt,
    make_loader,
    make_trainer,
)

GLOBAL_BATCH, STEPS_PER_EPOCH = 6, 3
LOSS_TOL = 1e-5

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


class FSDP2GPT(LitGPT):
    """LitGPT sharded by torch FSDP2 in ``configure_model``, as Lightning's ModelParallelStrategy expects."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _first_epoch_with_model_parallel(rank: int, world: int, out: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return fit_and_save(
        world, strategy, FSDP2GPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world), 1, out
    )


def _second_epoch_with_flatshard(rank: int, world: int, source: str, out_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    results = {}
    for kind in ("full", "sharded"):
        strategy = flatshard.FlatShardStrategy(state_dict_type=kind, auto_wrap_policy={Block})
        results[kind] = fit_and_save(
            world,
            strategy,
            LitGPT(seed=123),  # another init: everything must come from the checkpoint
            make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, world),
            2,
            os.path.join(out_dir, f"{kind}.ckpt"),
            ckpt_path=source,
        )
    return results


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("reference")
    recorder = LossRecorder()
    trainer = make_trainer(1, "auto", max_epochs=2, callbacks=[recorder])
    trainer.fit(LitGPT(), make_loader(STEPS_PER_EPOCH, GLOBAL_BATCH, 1))
    trainer.save_checkpoint(directory / "ref.ckpt")
    return {"ckpt": load_ckpt(directory / "ref.ckpt"), "losses": recorder.losses}


def test_flatshard_resumes_a_model_parallel_run_on_another_world_size(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    first = tmp_path / "model_parallel.ckpt"
    spawn(_first_epoch_with_model_parallel, 2, str(first))
    assert (first / "meta.pt").is_file() and not (first / "flatshard.meta").exists()
    second = spawn(_second_epoch_with_flatshard, 3, str(first), str(tmp_path))[0]
    expected = uninterrupted["ckpt"]
    for kind in ("full", "sharded"):
        losses = second[kind]["losses"]
        assert len(losses) == STEPS_PER_EPOCH, (kind, losses)
        for got, want in zip(losses, uninterrupted["losses"][STEPS_PER_EPOCH:]):
            assert abs(got - want) <= LOSS_TOL * max(1.0, abs(want)), (kind, losses, uninterrupted["losses"])
    full = load_ckpt(tmp_path / "full.ckpt")
    assert full["global_step"] == expected["global_step"] == 2 * STEPS_PER_EPOCH
    assert full["epoch"] == expected["epoch"] and full["loops"] == expected["loops"]
    assert_same_weights(full["state_dict"], expected["state_dict"], "resumed from ModelParallel")
    assert_same_optimizer_state(full["optimizer_states"][0], expected["optimizer_states"][0], "optimizer")

    # flatshard's own sharded directory is plain DCP: torch's converter gives the original shapes and values.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "sharded.ckpt", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert_same_weights(plain["model"], expected["state_dict"], "dcp_to_torch_save of flatshard's directory")
    assert torch.load(tmp_path / "sharded.ckpt" / "meta.pt", weights_only=False)["global_step"] == 6
