"""How Lightning's steps run through the sharded root: the Trainer strategy's step modes, in one object.

Lightning runs ``training_step`` and friends as the LightningModule's forward (its forward redirection), so
the root unit's hooks gather around the step. Three things differ from a plain module forward, and the
strategy owns them here; the engine only exposes the hooks they need (see [Note: calls routed through a
root's forward] and [Note: backward inside a forward] in ``flatshard.engine.runtime``):

- **input casts**: under autocast a step's arguments (the batch: inputs, targets, masks) keep their dtypes,
  as under DDP, instead of being cast like a unit's forward inputs (see [Note: mixed precision]);
- **tracking frozen parameters**: manual optimization may toggle ``requires_grad`` inside the step;
- **backward inside the forward**: manual optimization calls ``backward`` (and ``optimizer.step``) inside
  ``training_step``; the backward starts at the loss, and a step taken there gathers the root again;
- **uneven evaluation**: validate / test / predict loops (and the validation inside ``fit``) run inside
  ``flatshard.join`` (see [Note: joining uneven evaluation loops]): a rank whose last batch is done serves
  the others' all-gathers until every rank is done, right after that step, so the epoch-end reductions meet.
  The loop says which batch is its last (Lightning's ``is_last_batch``); were it not to, the join ends when
  the loop does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.nn import Module

from flatshard.engine import (
    ForwardCall,
    JoinState,
    begin_backward_in_forward,
    begin_join,
    end_join,
    forward_call,
    is_sharded,
    regather_in_forward,
)

__all__ = ["StepModes"]


class StepModes:
    """The step modes of one strategy. ``model`` is the strategy's model (the sharded root), if any."""

    def __init__(self) -> None:
        self._joining = False  # inside an evaluation loop's join
        self._join: JoinState | None = None  # None also when no forward communicates (NO_SHARD)

    def run(
        self,
        model: Module | None,
        method: str,
        step: Callable[[], Any],
        *,
        autocast: bool,
        manual_optimization: bool,
    ) -> Any:
        """Run ``step`` (the LightningModule's ``method`` through the root's forward) in its mode."""
        if model is None:
            return step()
        call = ForwardCall(
            cast_inputs=not autocast,
            track_frozen=method == "training_step" and manual_optimization,
        )
        with forward_call(model, call):
            return step()

    def before_backward(self, model: Module | None, loss: Tensor) -> None:
        """Manual optimization's backward runs inside ``training_step``: it starts at ``loss``."""
        if model is not None:
            begin_backward_in_forward(model, loss)

    def after_optimizer_step(self, model: Module | None) -> None:
        """A step taken inside ``training_step`` changed the shards the root still has gathered."""
        if model is not None:
            regather_in_forward(model)

    def begin_evaluation(self, model: Module | None) -> None:
        """An evaluation loop starts (on every rank): its forwards are joined."""
        self.end_evaluation(serve=False)  # a loop that ended without saying so (an exception) left nothing
        if model is not None and is_sharded(model):
            self._join = begin_join(model)
            self._joining = True

    def after_evaluation_step(self, last_batch: bool) -> None:
        """This rank's last batch is done: serve the other ranks until every rank is done."""
        if last_batch:
            self.end_evaluation()

    def end_evaluation(self, serve: bool = True) -> None:
        if self._joining:
            self._joining = False
            state, self._join = self._join, None
            end_join(state, serve=serve)

    def __getstate__(self) -> dict[str, Any]:  # the strategy is pickled by spawn launchers: no live join
        return {"_joining": False, "_join": None}
