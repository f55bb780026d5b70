"""``fabric.save(path, state, filter=...)`` with full state streams too (see [Note: streamed full saves]): the
filter is asked with each gathered tensor before it is written, and the file holds exactly what Fabric's own
save with that filter holds (the same keys and tensors; an entry whose filter keeps nothing left out). A filter
on an optimizer's state takes the whole-dict path and gives the same file as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
import flatshard.checkpoint.stream_save as stream_save
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

pytestmark = pytest.mark.slow

FILTERS: dict[str, Any] = {
    # by name, as adapters-only saves select (LoRA recipes keep "lora_" keys)
    "names": {"model": lambda k, v: ".ln" in k or k.startswith("head")},
    # by value: the filter sees the full tensor, not a piece
    "values": {"model": lambda k, v: v.dim() == 1 and v.numel() > 0},
    # nothing of the model: the entry is left out
    "nothing": {"model": lambda k, v: False},
    # a filter on the optimizer's state: the whole-dict path
    "optimizer": {"optimizer": lambda k, v: k == "param_groups"},
}


def _save(rank: int, world: int, tmp: str, case: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    streamed: list[int] = []
    original = stream_save.save_full_streamed

    def counting(path: Any, checkpoint: Any) -> Any:
        streamed.append(1)
        return original(path, checkpoint)

    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block})
    )
    fabric.launch()
    import flatshard.lightning.fabric as fabric_module

    fabric_module.save_full_streamed = counting  # type: ignore[assignment]
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    idx, tgt = make_batch(0, 2 * world)
    fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "step": 3}
    fabric.save(Path(tmp) / f"{case}.ckpt", state, filter=FILTERS[case])
    full, optim = flatshard.get_state_dict(model, optimizer.optimizer)
    return {"streamed": len(streamed), "model": full, "optim": optim}


@pytest.mark.parametrize("case", sorted(FILTERS))
def test_a_filtered_full_save_holds_what_fabric_keeps(tmp_path: Path, case: str) -> None:
    writer = spawn(_save, 2, str(tmp_path), case)[0]
    assert writer["streamed"] == (0 if case == "optimizer" else 1)
    saved = torch.load(tmp_path / f"{case}.ckpt", weights_only=True)
    # What Fabric's own save keeps: each filtered entry's dict, items the filter keeps; left out if none.
    expected: dict[str, Any] = {"model": writer["model"], "optimizer": writer["optim"], "step": 3}
    for key, keep in FILTERS[case].items():
        kept = {k: v for k, v in expected[key].items() if keep(k, v)}
        if kept:
            expected[key] = kept
        else:
            del expected[key]
    assert sorted(saved) == sorted(expected)
    if "model" in expected:
        assert sorted(saved["model"]) == sorted(expected["model"]) and saved["model"]
        for k, v in expected["model"].items():
            assert torch.equal(saved["model"][k], v), k
    assert saved["step"] == 3
