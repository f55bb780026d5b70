"""Sharded ("local") model and optimizer state: what each rank holds, without any communication.

[Note: sharded state]
Every managed parameter is described as a :class:`ParamShard`: this rank's contiguous piece of the
*flattened* full parameter, its offset in it and the full shape. Pieces of one parameter from all ranks
tile ``[0, numel)`` exactly (a rank may hold an empty piece), whatever the world size or wrap policy
was, so a checkpoint of pieces can be re-cut for any other layout by offset arithmetic alone
(``flatshard.checkpoint``). Elementwise optimizer state (``exp_avg``...) is cut exactly like its
parameter, so it is a ``ParamShard`` too; everything else (``step``, buffers, objects) is replicated.

The optimizer's sharded state names parameters, not positions: ``{"state": {name: {key: value}},
"param_groups": [{..., "params": [name, ...]}]}``, so it survives a change of wrap policy or world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.handle import handle_of_param
from flatshard.engine.precision import original_buffer_dtypes
from flatshard.engine.state.full_model import parameter_names, prepare_for_state_io
from flatshard.engine.state.full_optim import optimizer_params
from flatshard.engine.state.stand_ins import live_piece, saved_piece, saved_value
from flatshard.engine.state.whole_state import note_loaded_whole, states_as_pieces, whole_state_keys
from flatshard.engine.step.optimizer_offload import offload_plan

__all__ = [
    "ParamShard",
    "local_param_targets",
    "param_shard",
    "sharded_model_state_dict",
    "sharded_optim_state_dict",
    "to_local_model_state",
    "to_local_optim_state",
]


@dataclass(eq=False)
class ParamShard:
    """This rank's contiguous piece of a flattened full tensor.

    Compared and hashed by identity: one object under several names is one tensor (tied weights). Not frozen,
    so that collection walkers (Fabric's ``_unwrap_objects``) can rebuild a state holding pieces.

    Attributes:
        local: the piece, 1-D (possibly empty); for the live state it is a view, not a copy.
        offset: index of ``local[0]`` in the flattened full tensor (in the flattened ``block``, when there is one).
        shape: the full tensor's shape.
        block: for a tensor-parallel parameter, ``(offsets, sizes)`` of the block of the full tensor this rank's
            tensor-parallel group member holds, of which the piece is a flat range (see [Note: tensor
            parallelism]); ``None`` otherwise.
    """

    local: torch.Tensor
    offset: int
    shape: torch.Size
    block: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def with_local(self, local: torch.Tensor) -> ParamShard:
        """The same piece of the same tensor, held by ``local``."""
        return ParamShard(local, self.offset, self.shape, self.block)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full`` (a tensor of the full shape): a 1-D view where it can be."""
        if self.block is not None:
            for dim, (at, size) in enumerate(zip(*self.block, strict=True)):
                full = full.narrow(dim, at, size)
        return full.reshape(-1)[self.offset : self.offset + self.local.numel()]

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return (
            f"ParamShard(shape={tuple(self.shape)}, offset={self.offset}, local={self.local.numel()}, "
            f"dtype={self.local.dtype})"
        )


def param_shard(param: torch.Tensor) -> ParamShard | None:
    """``param``'s piece on this rank as a :class:`ParamShard` view (no copy); ``None`` for a parameter that
    belongs to no unit (ignored, or replicated here)."""
    handle = handle_of_param(param)
    if handle is None:
        return None
    i = handle.index_of(param)
    piece, offset = handle.piece(i).detach().reshape(-1), handle.shard_infos[i].offset_in_param
    layout = handle.tensor_parallel[i] if handle.tensor_parallel is not None else None
    if layout is not None:  # see [Note: tensor parallelism]
        return ParamShard(piece, offset, layout.shape, layout.block())
    return ParamShard(piece, offset, handle.layout.shapes[i])


def sharded_model_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state-dict keys; managed parameters as :class:`ParamShard` views (no copies).

    A parameter reachable under several names (tied weights) is the *same* ``ParamShard`` object under
    each, so writers can store it once. Buffers and unmanaged parameters are detached tensors.
    """
    prepare_for_state_io(module, "get_state_dict", reading=True)
    out: dict[str, Any] = {}
    shards: dict[int, ParamShard] = {}
    restore = original_buffer_dtypes(module)
    for key, value in module.state_dict(keep_vars=True).items():
        shard = param_shard(value) if isinstance(value, torch.Tensor) else None
        if shard is not None:
            if id(value) not in shards:  # the live piece, or what stands in for it (see [Note: stand-ins])
                shards[id(value)] = shard.with_local(saved_value(value, shard.local).reshape(-1))
            out[key] = shards[id(value)]
        elif isinstance(value, torch.Tensor):
            out[key] = saved_piece(value).to(restore.get(key, value.dtype))
        else:
            out[key] = value
    return out


def _optimizer_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = parameter_names(module)
    out = []
    for p in optimizer_params(optimizer):
        if id(p) not in names:
            raise ValueError(
                f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that is not a parameter "
                f"of {type(module).__name__}, so it has no name in a sharded checkpoint. HINT: build the "
                "optimizer from the sharded module's parameters."
            )
        out.append(names[id(p)])
    if len(set(out)) != len(out):
        raise ValueError(f"{type(optimizer).__name__} holds the same parameter twice.")
    return out


def sharded_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter name (see [Note: sharded state]); no copies."""
    prepare_for_state_io(module, "get_state_dict", reading=True)
    params = optimizer_params(optimizer)
    names = _optimizer_names(module, optimizer)
    offload_plan(optimizer)  # its later loads go to host memory: see [Note: optimizer offload]
    with states_as_pieces(optimizer):  # see [Note: saving whole-tensor optimizer state]
        local = optimizer.state_dict()
        whole = whole_state_keys(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for idx, entries in local["state"].items():
        p, name = params[idx], names[idx]
        shard = param_shard(p)
        piece = live_piece(p)  # the parameter's data between steps (inside unshard_params it is full)
        converted: dict[str, Any] = {}
        for key, value in entries.items():
            if (id(p), key) in whole:  # replicated, like ``step``
                converted[key] = value
            elif shard is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != piece.shape:
                    raise ValueError(
                        f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for "
                        f"{name!r}, whose local piece has shape {tuple(piece.shape)}; only elementwise optimizer "
                        "state can be sharded. HINT: use an elementwise optimizer (Adam, AdamW, SGD...)."
                    )
                converted[key] = shard.with_local(value.detach().reshape(-1))
            else:
                converted[key] = value
        state[name] = converted
    groups = []
    for group in local["param_groups"]:
        groups.append(dict(group, params=[names[i] for i in group["params"]]))
    return {"state": state, "param_groups": groups}


def local_param_targets(module: nn.Module) -> dict[str, tuple[torch.Tensor, ParamShard | None]]:
    """For every state-dict tensor key: (the live tensor, an empty ParamShard to read this rank's piece into).

    The ParamShard is ``None`` for buffers and unmanaged parameters (read whole).
    """
    prepare_for_state_io(module, "set_state_dict")
    out: dict[str, tuple[torch.Tensor, ParamShard | None]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        handle = handle_of_param(value)
        if handle is None:
            out[key] = (value, None)
            continue
        shard = param_shard(value)
        assert shard is not None
        empty = torch.empty(shard.local.numel(), dtype=value.dtype, device=value.device)
        out[key] = (value, shard.with_local(empty))
    return out


def to_local_model_state(module: nn.Module, loaded: Mapping[str, Any]) -> dict[str, Any]:
    """Turn read pieces into tensors shaped like the live local parameters, for ``load_state_dict``."""
    live = module.state_dict(keep_vars=True)
    out: dict[str, Any] = {}
    for key, value in loaded.items():
        if isinstance(value, ParamShard):
            out[key] = value.local.view(live[key].shape)
        else:
            out[key] = value
    return out


def to_local_optim_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    sharded: Mapping[str, Any],
    source: str,
    copy: bool = True,
) -> dict[str, Any]:
    """Validate a name-keyed sharded optimizer state for this rank and turn it into ``load_state_dict`` form.

    Raises ``ValueError`` naming ``source`` if groups or shapes do not fit; changes nothing. With ``copy``
    the pieces are cloned (``Optimizer.load_state_dict`` keeps the tensors it is given).
    """
    params = optimizer_params(optimizer)
    names = _optimizer_names(module, optimizer)
    saved_groups = sharded["param_groups"]
    now = [
        [names[i] for i in range(start, start + len(g["params"]))] for g, start in _group_starts(optimizer)
    ]
    saved = [list(g["params"]) for g in saved_groups]
    if [sorted(g) for g in saved] != [sorted(g) for g in now]:
        raise ValueError(
            f"{source}: the optimizer's param groups do not match the checkpoint's "
            f"(saved group sizes {[len(g) for g in saved]}, now {[len(g) for g in now]}"
            f"{_first_difference(saved, now)}). HINT: build the optimizer with the same parameter groups as when "
            "the checkpoint was saved. Nothing was loaded."
        )
    position = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    kept_whole: set[tuple[int, str]] = set()
    for name, entries in sharded["state"].items():
        if name not in position:
            continue
        pos = position[name]
        converted: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, ParamShard):
                if value.local.numel() != params[pos].numel():
                    raise ValueError(
                        f"{source}: state {key!r} of {name!r} holds {value.local.numel()} elements here, the "
                        f"parameter's piece {params[pos].numel()}. HINT: load sharded state through "
                        "flatshard.load_checkpoint to change world size or wrap policy. Nothing was loaded."
                    )
                local = value.local.view(params[pos].shape)
                converted[key] = local.clone() if copy else local
            else:
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and param_shard(params[pos]) is not None
                ):
                    kept_whole.add((id(params[pos]), key))  # whole state of a whole-tensor optimizer
                converted[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[pos] = converted
    note_loaded_whole(optimizer, kept_whole)
    offload_plan(optimizer)  # its load goes to host memory: see [Note: optimizer offload]
    groups = [
        dict(g, params=[position[n] for n in now_g]) for g, now_g in zip(saved_groups, now, strict=True)
    ]
    return {"state": state, "param_groups": groups}


def _group_starts(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], int]]:
    out, acc = [], 0
    for g in optimizer.param_groups:
        out.append((g, acc))
        acc += len(g["params"])
    return out


def _first_difference(saved: list[list[str]], now: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(saved, now)):
        missing, extra = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        if missing or extra:
            return f"; group {i}: not in the checkpoint {missing[:4]}, only in the checkpoint {extra[:4]}"
    return ""
