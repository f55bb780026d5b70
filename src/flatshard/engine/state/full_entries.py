"""What a full model state dict will hold, known before anything is gathered: each entry's name, dtype and
shape, which names are one tensor, and the order in which :class:`~flatshard.engine.FullStates` delivers them.

A writer that lays out files ahead of the data (Hugging Face's multi-file safetensors layout: which tensor goes
into which file, each file's header) needs these, and they cost no communication: the full shapes are in each
unit's layout, the dtypes are the shards' (buffers: their dtype before mixed precision cast them, as the full
state dict restores it). The entries are exactly those of
:func:`~flatshard.engine.state.full_model.full_model_state_dict` that are tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from flatshard.engine.precision import original_buffer_dtypes
from flatshard.engine.runtime import unit_states

__all__ = ["FullEntry", "full_entries"]


class FullEntry(NamedTuple):
    """One tensor entry of a module's full state dict."""

    key: str  # the state-dict key
    dtype: torch.dtype  # as the full state dict holds it
    shape: torch.Size  # the full shape
    first: str  # the first state-dict key of the same tensor (a tied parameter's names share it); ``key`` if none
    parameter: bool  # a parameter (not a buffer)
    arrival: (
        int  # the position in which FullStates.gather delivers this tensor (names of one tensor share it)
    )


def full_entries(module: nn.Module) -> list[FullEntry]:
    """The tensor entries of ``module``'s full state dict, in state-dict order; no communication.

    For a sharded module, ``arrival`` is the order of :meth:`~flatshard.engine.FullStates.gather`: the units'
    parameters as ``consume`` receives them (unit by unit, each unit's parameters in its flat order), then the
    entries it returns whole (buffers, parameters of no unit) in state-dict order. For a module without units,
    every entry arrives in state-dict order. Entries that are not tensors (``_extra_state`` objects) are left out.
    """
    state = module.state_dict(keep_vars=True)
    positions: dict[int, int] = {}  # id(tensor) -> its arrival
    shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
    wanted = {id(v) for v in state.values()}
    for unit in unit_states(module):
        for handle in unit.handles:
            for i, p in enumerate(handle.params):
                if id(p) in wanted:  # a parameter no key names is delivered too, and holds no entry
                    positions[id(p)] = len(positions)
                    shapes[id(p)] = (torch.Size(handle.full_shape(i)), handle.dtype)
    restore = original_buffer_dtypes(module)
    params = {id(p) for p in module.parameters()}
    first: dict[int, str] = {}
    for ident in [id(v) for v in state.values() if isinstance(v, torch.Tensor) and id(v) not in positions]:
        positions.setdefault(ident, len(positions))  # returned whole, after every unit, in state-dict order
    out: list[FullEntry] = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        ident = id(value)
        shape, dtype = shapes.get(ident, (value.shape, restore.get(key, value.dtype)))
        out.append(
            FullEntry(key, dtype, shape, first.setdefault(ident, key), ident in params, positions[ident])
        )
    return out
