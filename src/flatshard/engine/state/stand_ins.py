"""Where the state functions read a parameter's value: its live piece, or a stand-in for it.

[Note: stand-ins]
While an EMA is swapped in (:meth:`flatshard.engine.EMA.swap`) every averaged parameter's live piece
holds its EMA and the training weights wait in the EMA's shadow. A checkpoint taken then (a callback saving
in ``on_validation_epoch_end``, ``ModelCheckpoint``, ``fabric.save`` inside ``ema.swapped_in()``) must still
hold the training weights under the model's names, or a run resumed from it trains from the EMA. So the swap
registers the shadow as the parameter's *stand-in*, and every function that reads model state for keeping
(full and sharded model state dicts, hence ``get_state_dict``, ``save_checkpoint`` and both strategies' saves)
reads a parameter from its stand-in when it has one (:func:`saved_piece`), cast to the parameter's dtype.
Nothing is swapped or copied for a save, so the live state after it is exactly what it was, and a save works
at any moment the state functions work: between steps, inside ``unshard_params`` (they read the shards, not
the full views, see [Note: unshard_params]) and while an asynchronous save is in flight (it staged a copy).
Forwards, ``unshard_params`` and the optimizer keep using the live pieces. :func:`standing_in` sets stand-ins
for a block only: the EMA reads its own state that way, with the shadow standing in when it is not swapped in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from flatshard.engine.handle import handle_of_param

__all__ = [
    "live_piece",
    "live_pieces",
    "saved_piece",
    "saved_value",
    "set_stand_ins",
    "stand_in",
    "standing_in",
]

# A parameter's stand-in, in the parameter's own __dict__: it goes with the parameter (copies made by deepcopy
# have none).
_STAND_IN_ATTR = "_flatshard_stand_in"


def live_piece(param: torch.Tensor) -> torch.Tensor:
    """``param``'s piece of its unit's local shard (detached): its data between steps, and its shard inside
    ``unshard_params`` where its data is the full view; a parameter of no unit is itself, whole."""
    handle = handle_of_param(param)
    if handle is None:
        return param.detach()
    return handle.piece(handle.index_of(param)).detach()


def stand_in(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor standing in for ``param``'s live piece in saved state, if any (see [Note: stand-ins])."""
    found = param.__dict__.get(_STAND_IN_ATTR)
    return found if isinstance(found, torch.Tensor) else None


def live_pieces(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`live_piece` of each parameter, finding each in its unit once (a step's worth of calls)."""
    index: dict[int, dict[int, int]] = {}
    out = []
    for p in params:
        handle = handle_of_param(p)
        if handle is None:
            out.append(p.detach())
            continue
        where = index.get(id(handle))
        if where is None:
            where = index[id(handle)] = {id(q): i for i, q in enumerate(handle.params)}
        out.append(handle.piece(where[id(p)]).detach())
    return out


def saved_value(param: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """What state functions store for ``param`` whose live piece is ``live``: its stand-in in that dtype, else
    ``live``."""
    other = stand_in(param)
    return live if other is None else other.detach().to(live.dtype)


def saved_piece(param: torch.Tensor) -> torch.Tensor:
    """What state functions store for ``param``'s piece: its stand-in in its dtype, else :func:`live_piece`."""
    return saved_value(param, live_piece(param))


def set_stand_ins(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None) -> None:
    """Let ``values[i]`` (shaped like the live piece) stand in for ``params[i]``; ``None``: remove theirs."""
    for i, p in enumerate(params):
        if values is None:
            p.__dict__.pop(_STAND_IN_ATTR, None)
        else:
            p.__dict__[_STAND_IN_ATTR] = values[i]


@contextmanager
def standing_in(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """:func:`set_stand_ins` inside the block only; the stand-ins from before are back after it."""
    before = [stand_in(p) for p in params]
    set_stand_ins(params, values)
    try:
        yield
    finally:
        for p, value in zip(params, before, strict=True):
            if value is None:
                p.__dict__.pop(_STAND_IN_ATTR, None)
            else:
                p.__dict__[_STAND_IN_ATTR] = value
