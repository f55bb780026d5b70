"""``LoadPretrained``: the Trainer's side of starting from a pretrained Hugging Face checkpoint.

[Note: the pretrained recipe under the Trainer]
The LightningModule builds its model on the meta device in ``configure_model``; the strategy shards it
(nothing is materialized in full, the parameters stay unfilled: see [Note: unfilled tensors]); this callback
then fills it with :func:`flatshard.load_pretrained`, once, before the first forward: at the start of the
sanity check, of training, validation, testing or prediction, whichever comes first. Not in ``on_fit_start``:
a sharding strategy restores a checkpoint after it (``restore_checkpoint_after_setup``). A run resumed with
``ckpt_path`` gets its weights from the checkpoint, restored before these hooks, with this callback's state
(``done``): it does not read the pretrained weights again.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from flatshard.checkpoint import PretrainedLoad, load_pretrained

__all__ = ["LoadPretrained"]


class LoadPretrained(Callback):
    """Fill the LightningModule from a Hugging Face checkpoint once, before its first forward.

    Args:
        source: a Hugging Face model directory, a ``.safetensors`` file or an index, local or any fsspec URL.
        prefix: taken off the LightningModule's names to get the checkpoint's (``"model."`` when the Hugging
            Face model is ``self.model``).
        strict: raise on names the checkpoint lacks or nothing takes (see :func:`flatshard.load_pretrained`).
    """

    def __init__(self, source: str | os.PathLike[str], prefix: str = "", strict: bool = True) -> None:
        self.source = os.fspath(source)
        self.prefix = prefix
        self.strict = strict
        self.done = False  # loaded, or the run resumed from a checkpoint (its weights win)
        self.result: PretrainedLoad | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(source=self.source, prefix=self.prefix)

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.done:
            return
        self.done = True
        if trainer.ckpt_path is not None:  # the checkpoint's weights were restored: see the module note
            return
        self.result = load_pretrained(pl_module, self.source, prefix=self.prefix, strict=self.strict)

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict.get("done", False)) or self.done
