"""A Hugging Face model trained by a 2-rank Trainer leaves as a directory ``from_pretrained`` reads.

A LightningModule holding a tiny GPT-2 as ``self.model`` trains 2 steps under ``strategy="flatshard"`` and
saves a sharded directory; ``flatshard consolidate DIR OUT/model.safetensors --prefix model.`` plus
``config.save_pretrained(OUT)`` is then a model directory: ``AutoModelForCausalLM.from_pretrained(OUT)`` loads
every weight (the head re-tied to the embedding, which the file stores once) and gives the logits the trained
model gave on the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import flatshard
from flatshard.cli import main
from flatshard.testing import spawn
from tests.lightning.lit_common import make_trainer

from .hf_common import WEIGHT_TOL, LitHF, assert_ties, build_config, make_loader, prompt

pytestmark = pytest.mark.slow

STEPS = 2
GLOBAL_BATCH = 4


def _train(rank: int, world: int, path: str) -> torch.Tensor:
    """Fit, save a sharded directory, and return the trained model's logits on the fixed prompt."""
    torch.set_num_threads(1)
    module = LitHF("gpt2")
    strategy = flatshard.FlatShardStrategy(state_dict_type="sharded", auto_wrap_policy={GPT2Block})
    trainer = make_trainer(world, strategy, max_epochs=1)
    trainer.fit(module, make_loader("gpt2", STEPS, GLOBAL_BATCH, world))
    assert trainer.global_step == STEPS
    trainer.save_checkpoint(path)
    module.eval()
    with torch.no_grad(), flatshard.unshard_params(module, writeback=False):
        logits: torch.Tensor = module.model(**prompt("gpt2")).logits
    return logits


@pytest.mark.timeout(300)
def test_exported_directory_loads_with_from_pretrained(tmp_path: Path, capsys: Any) -> None:
    sharded = tmp_path / "sharded.ckpt"
    expected = spawn(_train, 2, str(sharded))[0]
    out = tmp_path / "tiny-gpt2"
    assert main(["consolidate", str(sharded), str(out / "model.safetensors"), "--prefix", "model."]) == 0
    assert "lm_head.weight -> transformer.wte.weight" in capsys.readouterr().out
    build_config("gpt2").save_pretrained(out)

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_ties("gpt2", model)
    with torch.no_grad():
        logits = model.eval()(**prompt("gpt2")).logits
    torch.testing.assert_close(logits, expected, **WEIGHT_TOL)
