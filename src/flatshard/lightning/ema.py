"""``ShardedEMA``: an exponential moving average of the weights as a Lightning callback, kept per shard."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from flatshard.engine import EMA as _EngineEMA
from flatshard.engine import check_decay, is_sharded, saved_piece, stand_in

__all__ = ["ShardedEMA"]


class ShardedEMA(Callback):
    """Keep an exponential moving average of the LightningModule's weights, shard by shard (no gather while
    training; see [Note: sharded EMA]), evaluate on it, and save it with every checkpoint.

    Works with ``FlatShardStrategy`` (the EMA of each rank's pieces) and with any other strategy whose
    parameters are whole (DDP, single device).

    - After every ``every_n_steps``-th optimizer step: ``ema = decay * ema + (1 - decay) * weights``.
    - ``swap_eval=True``: validation and test run on the EMA weights (swapped in place at the loop's start
      and back at its end, before ``ModelCheckpoint`` saves), so logged metrics are the EMA's. Predict
      too with ``swap_predict=True``. A checkpoint saved while the EMA is swapped in (a callback saving in
      ``on_validation_epoch_end``) still holds the training weights under ``state_dict``, and saving leaves
      the swapped-in weights exactly as they were.
    - Checkpoints hold the EMA under the callback's state: ``checkpoint["callbacks"][<state key>]
      ["ema_state_dict"]``, the model's state-dict names mapped to tensors. A full file holds it consolidated,
      loadable into the plain model; a sharded directory (``FlatShardStrategy(state_dict_type="sharded")``)
      stores each rank's pieces like the parameters', with no gather (``flatshard consolidate`` turns them
      into the full tensors, ``--ema`` exports them). Resuming on any number of devices restores each rank's
      slices.

    Args:
        decay: the running average's weight in ``[0, 1)``. Default: ``0.999``.
        every_n_steps: update after every n-th optimizer step. Default: ``1``.
        swap_eval: evaluate (validation and test) on the EMA weights. Default: ``True``.
        swap_predict: predict on the EMA weights. Default: ``False``.
    """

    # Its on_save_checkpoint changes state_dict only under strategies that do not stream (see [Note: streamed
    # Trainer saves]).
    flatshard_stream_safe = True

    def __init__(
        self, decay: float = 0.999, every_n_steps: int = 1, swap_eval: bool = True, swap_predict: bool = False
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ShardedEMA(every_n_steps={every_n_steps!r}) must be a positive int.")
        self.decay = check_decay(decay)
        self.every_n_steps = every_n_steps
        self.swap_eval = swap_eval
        self.swap_predict = swap_predict
        self.ema: _EngineEMA | None = None
        self._pending: dict[str, Any] | None = None  # loaded before the model was set up
        self._last_step = -1
        self._trainer: pl.Trainer | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay, every_n_steps=self.every_n_steps)

    def _ensure(self, pl_module: pl.LightningModule) -> _EngineEMA:
        if self.ema is None or self.ema.module is not pl_module:
            self.ema = _EngineEMA(pl_module, self.decay)
            if self._pending is not None:
                state, self._pending = self._pending, None
                self.ema.load_state(state["ema_state_dict"])
                self.ema.num_updates = int(state.get("num_updates", 0))
        return self.ema

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def _saves_sharded(self) -> bool:
        """Whether the trainer's checkpoints are sharded directories (the EMA is then saved as pieces)."""
        from flatshard.lightning.strategy import FlatShardStrategy

        strategy = None if self._trainer is None else self._trainer.strategy
        return isinstance(strategy, FlatShardStrategy) and strategy.options.state_dict_type == "sharded"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure(pl_module)
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step in this batch
            return
        self._last_step = step
        if step % self.every_n_steps == 0:
            self._ensure(pl_module).update()

    def _swap_in(self, pl_module: pl.LightningModule) -> None:
        ema = self._ensure(pl_module)
        if not ema.swapped:
            ema.swap()

    def _swap_out(self) -> None:
        if self.ema is not None and self.ema.swapped:
            self.ema.swap()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.swap_eval:
            self._swap_in(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.swap_eval:
            self._swap_in(pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.swap_predict:
            self._swap_in(pl_module)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._swap_out()

    @override
    def state_dict(self) -> dict[str, Any]:
        """Lightning calls it on every rank when it saves: for a sharded directory this rank's EMA pieces (no
        communication), else the consolidated EMA on rank 0 (collective)."""
        if self.ema is None:
            return dict(self._pending) if self._pending is not None else {}
        # Neither swaps: a save from inside an evaluation on the EMA leaves the live weights as they are.
        state = self.ema.sharded_state_dict() if self._saves_sharded() else self.ema.full_state_dict()
        return {"decay": self.decay, "num_updates": self.ema.num_updates, "ema_state_dict": state}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A save while the EMA is swapped in keeps the training weights under ``state_dict``: flatshard's
        state functions read them from the EMA's shadow already (see [Note: stand-ins]); strategies that read
        ``pl_module.state_dict()`` (DDP, one device) got the EMA, which is replaced here."""
        if self.ema is None or not self.ema.swapped or is_sharded(pl_module):
            return
        saved = checkpoint.get("state_dict")
        if not isinstance(saved, dict):
            return
        for key, value in pl_module.state_dict(keep_vars=True).items():
            if key in saved and isinstance(value, torch.Tensor) and stand_in(value) is not None:
                saved[key] = saved_piece(value).to(saved[key].device, copy=True)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ema_state_dict" not in state_dict:
            return
        self._pending = dict(state_dict)
        if self.ema is not None:
            module, self.ema = self.ema.module, None
            self._ensure(module)  # type: ignore[arg-type]
