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
then sees placeholders under those two keys. Any other caller of ``lightning_module_state_dict`` gets the whole
dict, and an asynchronous save (which writes after the call returns) always does.

How the strategy knows it is inside ``Trainer.save_checkpoint``: in ``setup`` it wraps that method on its own
Trainer instance (an instance attribute, :class:`TrainerSaves`), once; the wrapper counts the calls in progress.
Every route to a Trainer save goes through the instance attribute (``ModelCheckpoint``, the user's own
``trainer.save_checkpoint``), nothing is patched on the class, and the count lives on the strategy. A call
without ``weights_only`` passes Lightning's default (``False``) itself, so no rank logs that it was not set.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TrainerSaves", "hook_reading_state"]

log = logging.getLogger(__name__)


class TrainerSaves:
    """Whether the strategy is being asked for state from inside its Trainer's ``save_checkpoint``.

    ``watch(trainer)`` wraps the Trainer instance's ``save_checkpoint`` (once, however often ``setup`` runs);
    ``active`` is true while such a call is in progress. Also says once per hook why a save was not streamed.
    """

    def __init__(self) -> None:
        self.calls_in_progress = 0
        self._reported: set[str] = set()  # hooks already named in the log

    @property
    def active(self) -> bool:
        return self.calls_in_progress > 0

    def watch(self, trainer: pl.Trainer) -> None:
        current = trainer.__dict__.get("save_checkpoint")
        if isinstance(current, _WatchedSave) and current.saves is self:
            return
        trainer.save_checkpoint = _WatchedSave(trainer.save_checkpoint, self)  # type: ignore[method-assign]

    def report_not_streamed(self, hook: str) -> None:
        """Say once per hook why a full save was not streamed."""
        if hook in self._reported:
            return
        self._reported.add(hook)
        log.info(
            "flatshard: this full checkpoint is gathered whole before it is written, not streamed, because %s "
            "may read or change checkpoint['state_dict'] or ['optimizer_states']. If it leaves them alone, set "
            "the class attribute flatshard_stream_safe = True on it (see docs/checkpoints.md).",
            hook,
        )


class _WatchedSave:
    """A Trainer's own ``save_checkpoint``, counting its calls in progress (a class, so a Trainer still pickles)."""

    def __init__(self, save: Any, saves: TrainerSaves) -> None:
        functools.update_wrapper(self, save)
        self.save = save
        self.saves = saves

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("weights_only") is None:
            # Lightning's default, said explicitly: otherwise every rank logs "`weights_only` was not set"
            kwargs["weights_only"] = False
        self.saves.calls_in_progress += 1
        try:
            return self.save(*args, **kwargs)
        finally:
            self.saves.calls_in_progress -= 1


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
