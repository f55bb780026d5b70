"""An exponential moving average of a sharded model's weights, kept shard by shard.

[Note: sharded EMA]
Between steps each parameter of a sharded module holds this rank's piece of its unit's flat parameter
(see ``flatshard.engine.handle``), so an average of those pieces is an average of the whole model split
the same way: :class:`EMA` keeps one fp32 tensor per parameter, shaped like the local piece, and
updates it with ``ema += (1 - decay) * (param - ema)`` after optimizer steps. Nothing is gathered, and the
EMA costs one fp32 copy of this rank's shard. Parameters flatshard does not manage (ignored modules) are
averaged whole, on every rank alike.

- **Evaluation on the EMA** (:meth:`EMA.swap`): the EMA and the live pieces trade places in place,
  so forwards gather the EMA weights; swapping again restores the training weights exactly. While swapped in,
  the shadow stands in for the live pieces in every saved model state (see [Note: stand-ins]): a checkpoint
  taken during an evaluation on the EMA holds the training weights under the model's names.
- **Full state** (:meth:`EMA.full_state_dict`, collective): the EMA weights, consolidated under the
  model's state-dict names (buffers at their current values), on rank 0 — loadable into the plain model.
  It gathers as ``get_state_dict`` does, with the EMA standing in for the parameters: nothing is swapped, so
  it works wherever ``get_state_dict`` does (inside ``unshard_params`` too).
- **Sharded state** (:meth:`EMA.sharded_state_dict`, no communication): this rank's EMA pieces as
  :class:`~flatshard.engine.ParamShard` views under the model's state-dict names, which a sharded checkpoint
  stores piece by piece; loading takes this rank's piece of each (:meth:`EMA.load_state`).
- **Loading on any world size** (:meth:`EMA.load_full_state_dict`): from a full EMA state dict,
  every rank keeps its slices, as ``set_state_dict`` does for the model (it is used for the slicing, with
  the training weights put back afterwards).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.runtime import Summoned, unit_states
from flatshard.engine.shard import is_sharded
from flatshard.engine.state.sharded import ParamShard, param_shard
from flatshard.engine.state.stand_ins import live_pieces, saved_piece, set_stand_ins, standing_in
from flatshard.engine.state.state_dict import get_state_dict, set_state_dict

__all__ = ["EMA", "check_decay"]


def check_decay(decay: object) -> float:
    """``decay`` as a float, or a ``ValueError`` with a hint unless it is a number in ``[0, 1)``."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(
            f"EMA(decay={decay!r}): decay must be a number in [0, 1). HINT: typical values are 0.999 "
            "to 0.9999 (an average over about 1/(1 - decay) steps)."
        )
    return float(decay)


class EMA:
    """The EMA of ``module``'s trainable parameters, one fp32 piece per parameter (see [Note: sharded EMA]).

    Args:
        module: a module sharded with ``flatshard.shard`` (an unsharded module works too: its parameters are
            whole).
        decay: the weight of the running average, in ``[0, 1)``: ``ema = decay * ema + (1 - decay) * param``.
    """

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.module = module
        self.decay = check_decay(decay)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]
        self.num_updates = 0
        self.swapped = False

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into the average (after an optimizer step); no communication."""
        if self.swapped:
            raise RuntimeError(
                "EMA.update() while the EMA weights are swapped in. HINT: swap back first (the model "
                "holds the EMA weights, not the trained ones)."
            )
        weight = 1.0 - self.decay
        for live, s in zip(live_pieces(self.params), self.shadow, strict=True):
            s.lerp_(live.to(s.dtype), weight)
        self.num_updates += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the EMA and the live weights in place (call on every rank; again to undo). While the EMA is
        swapped in, saved model state holds the training weights (see [Note: stand-ins])."""
        summoned = [s for s in unit_states(self.module) if s.summoned is not Summoned.NO]
        if summoned:
            raise RuntimeError(
                f"EMA.swap() inside flatshard.unshard_params of {type(summoned[0].module).__name__}: the "
                "full parameters there are a copy that the swap would not reach, and leaving the context would "
                "write it back over the swapped pieces. HINT: swap before entering unshard_params (ema.swapped_in() "
                "around it) or after leaving it."
            )
        for live, s in zip(live_pieces(self.params), self.shadow, strict=True):
            kept = live.clone()
            live.copy_(s)
            s.copy_(kept)
        self.swapped = not self.swapped
        set_stand_ins(self.params, self.shadow if self.swapped else None)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights on the model inside the block, the training weights back after it."""
        if self.swapped:
            yield
            return
        self.swap()
        try:
            yield
        finally:
            self.swap()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The consolidated EMA under the model's state-dict names (collective; empty off rank 0 with
        ``rank0_only``). Values are in the parameters' dtype, on the CPU."""
        with self._ema_standing_in():
            if not is_sharded(self.module):  # whole parameters (DDP, one device): nothing to gather
                return {
                    k: saved_piece(v).cpu().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in self.module.state_dict(keep_vars=True).items()
                }
            state, _ = get_state_dict(self.module, rank0_only=rank0_only)
        return state

    def _ema_standing_in(self) -> AbstractContextManager[None]:
        """The EMA as saved state reads the parameters: the shadow, or (swapped in) the live pieces."""
        return standing_in(self.params, None if self.swapped else self.shadow)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's EMA under the model's state-dict names, without communication: managed parameters as
        :class:`ParamShard` views of the fp32 pieces (a tied parameter is one object under each name), the rest
        (unmanaged parameters, buffers) whole. Frozen parameters and buffers hold their live values."""
        shadow = {id(p): s for p, s in zip(self.params, self.shadow, strict=True)}
        out: dict[str, Any] = {}
        made: dict[int, Any] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) not in made:
                shard = param_shard(value)  # the live piece, also inside unshard_params
                live = shard.local if shard is not None else value.detach()
                ema = live if self.swapped or id(value) not in shadow else shadow[id(value)].detach()
                if shard is not None:
                    made[id(value)] = shard.with_local(ema.reshape(-1))
                else:
                    made[id(value)] = ema
            out[key] = made[id(value)]
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Load an EMA state dict: full tensors (:meth:`full_state_dict`) or this rank's pieces
        (:meth:`sharded_state_dict`, as a sharded checkpoint hands them back on any world size)."""
        if not any(isinstance(v, ParamShard) for v in state.values()):
            self.load_full_state_dict(state)
            return
        if self.swapped:
            raise RuntimeError("EMA.load_state() while swapped in. HINT: swap back first.")
        index = {id(p): i for i, p in enumerate(self.params)}
        pieces: dict[int, torch.Tensor] = {}
        for key, live in self.module.state_dict(keep_vars=True).items():
            i = index.get(id(live)) if isinstance(live, torch.Tensor) else None
            if i is None or i in pieces:
                continue
            if key not in state:
                raise ValueError(f"The EMA state has no entry {key!r}. HINT: load the EMA of the same model.")
            value = state[key]
            shard = param_shard(live)
            if isinstance(value, ParamShard):
                piece = value.local
            elif shard is not None:
                piece = shard.cut(value)  # a tensor-parallel piece within its block too
            else:
                piece = value
            if piece.numel() != self.shadow[i].numel():
                raise ValueError(
                    f"The EMA state's {key!r} holds {piece.numel()} elements here, the parameter's piece "
                    f"{self.shadow[i].numel()}. HINT: load the EMA of the same model."
                )
            pieces[i] = piece
        with torch.no_grad():
            for i, piece in pieces.items():
                self.shadow[i].copy_(piece.reshape(self.shadow[i].shape))

    def load_full_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take this rank's slices of a full EMA state dict (any world size; call on every rank with the
        same ``state``). Missing or unexpected names raise, before anything changes."""
        if self.swapped:
            raise RuntimeError("EMA.load_full_state_dict() while swapped in. HINT: swap back first.")
        kept = [p.detach().clone() for p in self.params]
        buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        if is_sharded(self.module):
            set_state_dict(self.module, None, state)
        else:
            self.module.load_state_dict(state, strict=True)
        with torch.no_grad():
            for p, s, k in zip(self.params, self.shadow, kept, strict=True):
                s.copy_(p.detach())
                p.detach().copy_(k)
            for n, b in self.module.named_buffers():  # the EMA does not own buffers: keep the live ones
                if n in buffers:
                    b.copy_(buffers[n])
