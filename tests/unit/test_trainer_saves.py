"""How the strategy knows a Trainer save is in progress (see [Note: streamed Trainer saves]): the Trainer
instance's own ``save_checkpoint`` is wrapped once, the class is left alone, and the count is exact."""

from __future__ import annotations

import pickle
from typing import Any

import lightning.pytorch as L

from flatshard.lightning.streamed_saves import TrainerSaves


class _Saving(L.Trainer):
    def save_checkpoint(self, filepath: Any, weights_only: bool = False, storage_options: Any = None) -> None:
        self.seen.append((filepath, weights_only, self.watcher.active))

    seen: list[Any]
    watcher: TrainerSaves


def _trainer() -> _Saving:
    trainer = _Saving(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.seen = []
    return trainer


def test_the_instance_is_wrapped_once_and_counts_calls_in_progress() -> None:
    on_class = L.Trainer.save_checkpoint
    trainer, saves = _trainer(), TrainerSaves()
    trainer.watcher = saves
    saves.watch(trainer)
    saves.watch(trainer)  # setup runs again for validate/test: still one wrapper
    assert not saves.active
    trainer.save_checkpoint("a.ckpt", weights_only=True)
    trainer.save_checkpoint("b.ckpt")
    trainer.save_checkpoint("c.ckpt", None)
    assert trainer.seen == [("a.ckpt", True, True), ("b.ckpt", False, True), ("c.ckpt", None, True)]
    assert not saves.active and saves.calls_in_progress == 0
    assert "save_checkpoint" in vars(trainer) and L.Trainer.save_checkpoint is on_class


def test_a_failing_save_leaves_no_call_in_progress() -> None:
    trainer, saves = _trainer(), TrainerSaves()

    def fail(*args: Any, **kwargs: Any) -> None:
        assert saves.active
        raise OSError("disk full")

    trainer.save_checkpoint = fail  # type: ignore[method-assign]
    saves.watch(trainer)
    try:
        trainer.save_checkpoint("c.ckpt")
    except OSError:
        pass
    assert saves.calls_in_progress == 0


def test_another_strategy_wraps_its_own_trainer_only() -> None:
    first, second = _trainer(), _trainer()
    a, b = TrainerSaves(), TrainerSaves()
    first.watcher, second.watcher = a, b
    a.watch(first)
    b.watch(second)
    first.save_checkpoint("x")
    assert first.seen == [("x", False, True)] and not b.active


class _Saver:
    def save_checkpoint(self, filepath: str, weights_only: bool | None = None) -> str:
        return filepath


def test_a_watched_object_still_pickles() -> None:
    saver, saves = _Saver(), TrainerSaves()
    saves.watch(saver)  # type: ignore[arg-type]
    copy = pickle.loads(pickle.dumps(saver))
    assert copy.save_checkpoint("y") == "y" and copy.__dict__["save_checkpoint"].saves.calls_in_progress == 0
