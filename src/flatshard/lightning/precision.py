"""Precision plugin: full precision, with gradient-norm clipping over the whole sharded model."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from flatshard.engine.clip import clip_grad_norm_params_

__all__ = ["FlatShardPrecision", "to_flatshard_precision"]


class FlatShardPrecision(Precision):
    """``"32-true"`` for flatshard: clipping by norm uses the norm of the full gradient across shards."""

    precision = "32-true"

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_params_(self.main_params(optimizer), float(clip_val))


def to_flatshard_precision(plugin: Any) -> FlatShardPrecision | None:
    """Accept ``None``, our plugin, or Lightning's plain ``"32-true"`` plugin; refuse the rest clearly."""
    if plugin is None or isinstance(plugin, FlatShardPrecision):
        return plugin
    if type(plugin) is Precision:
        return FlatShardPrecision()
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise NotImplementedError(
        f"precision={name!r} ({type(plugin).__name__}) is not available with flatshard in this release yet: mixed "
        "and low precision arrive with the precision and memory issue. HINT: use precision='32-true'."
    )
