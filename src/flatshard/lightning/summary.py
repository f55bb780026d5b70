"""``ModelSummary`` / ``RichModelSummary`` under flatshard: the model's parameter counts, not the shards'.

Lightning's summary counts ``p.numel()`` of every parameter when ``fit`` starts. Between steps a sharded
parameter's data is this rank's 1-D piece, so the table would show each rank's share (a 809K-parameter
GPT on 2 processes as "404 K"). The strategy has each summary callback count inside
:func:`flatshard.engine.original_shapes`: every parameter shows its original shape (zero strides, no
values, no memory) while the counts are taken. The summary itself (and a forward of
``example_input_array``, which gathers like any forward) is made outside it, as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import ModelSummary

from flatshard.engine import is_sharded, original_shapes

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["count_full_parameters"]


class _FullCounts:
    """Replaces a summary callback's ``on_fit_start`` on the instance (picklable, unlike a closure)."""

    def __init__(self, callback: ModelSummary) -> None:
        self.callback = callback

    def __call__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback, cls = self.callback, type(self.callback)
        if not is_sharded(pl_module):
            cls.on_fit_start(callback, trainer, pl_module)
            return
        made = cls._summary(callback, trainer, pl_module)  # example_input_array's forward gathers as usual
        callback._summary = lambda *_: made  # type: ignore[method-assign]
        try:
            with original_shapes(pl_module):
                cls.on_fit_start(callback, trainer, pl_module)
        finally:
            del callback._summary  # back to the class's method


def count_full_parameters(trainer: pl.Trainer) -> None:
    """Make every ``ModelSummary`` callback of ``trainer`` (``RichModelSummary`` too) count full parameters."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary) and not isinstance(callback.on_fit_start, _FullCounts):
            callback.on_fit_start = _FullCounts(callback)  # type: ignore[method-assign]
