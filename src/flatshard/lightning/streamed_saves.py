"""When the Trainer's full save is written as it is gathered.

[Note: streamed Trainer saves]
``Trainer.save_checkpoint`` (``ModelCheckpoint`` calls it) builds the whole checkpoint dict first
(``dump_checkpoint``: the strategy's ``lightning_module_state_dict`` and ``optimizer_state``, then callbacks'
and the LightningModule's ``on_save_checkpoint`` hooks), then hands it to the strategy's ``save_checkpoint``.
Gathering the full state there holds the whole consolidated model and optimizer state on rank 0 at once.

So within that call, and only there, the strategy returns placeholders for the model and each optimizer
(:class:`~flatshard.checkpoint.ModelState`, :class:`~flatshard.checkpoint.OptimizerState`) and its
``save_checkpoint`` writes them as they are gathered, one unit at a time (see [Note: streamed full saves]): the
file is the same. Two things can see the dict between the two calls and might read or change its tensors,
the hooks: a ``on_save_checkpoint`` of the LightningModule, of a callback or of the precision plugin. Where one
is overridden, that save builds the whole dict as before, and the log says once which hook kept it from
streaming. A hook that leaves ``state_dict`` and ``optimizer_states`` alone (it adds entries, or reads others)
says so with a class attribute ``flatshard_stream_safe = True`` (flatshard's own callback and plugin do); it
then sees placeholders under those two keys. Any caller of ``lightning_module_state_dict`` other than
``Trainer.save_checkpoint`` (found on the call stack) gets the whole dict, and an asynchronous save (which
writes after the call returns) always does.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["hook_reading_state", "inside_trainer_save", "report_not_streamed"]

log = logging.getLogger(__name__)

_SAVE_CODE = getattr(Trainer.save_checkpoint, "__code__", None)
_MAX_DEPTH = 8  # Trainer.save_checkpoint -> dump_checkpoint -> _get_lightning_module_state_dict -> here
_reported: set[str] = set()


def inside_trainer_save() -> bool:
    """Whether ``Trainer.save_checkpoint`` is a few frames up the stack (it is building a checkpoint to save)."""
    if _SAVE_CODE is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_code is _SAVE_CODE:
            return True
        frame = frame.f_back
    return False


def _overrides(obj: Any, base: type) -> bool:
    hook = getattr(type(obj), "on_save_checkpoint", None)
    return hook is not None and hook is not getattr(base, "on_save_checkpoint", None)


def _safe(obj: Any) -> bool:
    return bool(getattr(obj, "flatshard_stream_safe", False))


def hook_reading_state(trainer: pl.Trainer) -> str | None:
    """The first ``on_save_checkpoint`` hook that may read the model or optimizer state (overridden and not
    marked ``flatshard_stream_safe``), named; ``None`` when there is none."""
    candidates: list[tuple[Any, type]] = [(trainer.lightning_module, LightningModule)]
    candidates += [(cb, Callback) for cb in getattr(trainer, "callbacks", [])]
    candidates.append((trainer.precision_plugin, Precision))
    for obj, base in candidates:
        if obj is not None and _overrides(obj, base) and not _safe(obj):
            return f"{type(obj).__qualname__}.on_save_checkpoint"
    return None


def report_not_streamed(hook: str) -> None:
    """Say once per hook why a full save was not streamed."""
    if hook in _reported:
        return
    _reported.add(hook)
    log.info(
        "flatshard: this full checkpoint is gathered whole before it is written, not streamed, because %s may "
        "read or change checkpoint['state_dict'] or ['optimizer_states']. If it leaves them alone, set the class "
        "attribute flatshard_stream_safe = True on it (see docs/checkpoints.md).",
        hook,
    )
