"""Full optimizer state: exactly what the plain, unsharded optimizer's ``state_dict()`` would be.

[Note: optimizer state consolidation]
An elementwise optimizer's per-parameter tensors (``exp_avg``, ``momentum_buffer``...) have the shape of
the local parameter piece, so a unit's state for one key is laid out exactly like its flat parameter.
Gathering is therefore one stream per (unit, key) of the shards straight into full-shape tensors (see
[Note: streamed full-state gathers]), never one broadcast per rank. Everything that is not such a tensor (``step``, hyper-parameters,
which keys exist and their dtypes) travels in a single object collective per optimizer.
Indices follow ``param_groups`` order, as ``torch.optim.Optimizer.state_dict()`` numbers them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.handle import FlatParamHandle, locate_params
from flatshard.engine.state.full_model import copy_out, prepare_for_state_io
from flatshard.engine.state.stream_gather import GatherItem, gather_items
from flatshard.engine.state.whole_state import (
    after_load,
    note_loaded_whole,
    states_as_pieces,
    whole_state_keys,
)
from flatshard.engine.step.optimizer_offload import offload_plan
from flatshard.engine.step.whole_tensor import is_whole_tensor_optimizer
from flatshard.engine.transport.comm import global_rank

__all__ = [
    "convert_full_optim_state_dict",
    "full_optim_state_dict",
    "load_converted_optim_state",
    "load_full_optim_state_dict",
    "optimizer_params",
    "plan_full_optim_state_dict",
]


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``param_groups`` order: the order ``state_dict()`` numbers them in."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_sharded_state(handle: FlatParamHandle | None, value: Any) -> bool:
    """State laid out like its parameter's piece: gathered (and cut) with the flat parameter. A tensor-parallel
    model's always is, over its data-parallel group and then its tensor-parallel one."""
    return (
        handle is not None
        and (handle.shard_world > 1 or handle.tensor_parallel is not None)
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
    )


def full_optim_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True, to_cpu: bool = True
) -> dict[str, Any]:
    """Gather the full optimizer state (see [Note: optimizer state consolidation]). Run on all ranks."""
    keep = global_rank() == 0 or not rank0_only
    items, assemble = plan_full_optim_state_dict(module, optimizer, keep=keep, to_cpu=to_cpu)
    return assemble(gather_items(items, keep))


def plan_full_optim_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: bool,
    to_cpu: bool,
) -> tuple[list[GatherItem], Callable[[list[dict[int, torch.Tensor]]], dict[str, Any]]]:
    """Agree on the state's metadata (all ranks); return what to gather and how to build the state."""
    prepare_for_state_io(module, "get_state_dict", reading=True)
    params = optimizer_params(optimizer)
    located = locate_params(params)
    offload_plan(optimizer)  # its later loads go to host memory: see [Note: optimizer offload]
    with states_as_pieces(optimizer):  # see [Note: saving whole-tensor optimizer state]
        local = optimizer.state_dict()
        whole = whole_state_keys(optimizer)

    def cut(idx: int, key: str, value: Any) -> bool:  # a piece of a tensor shaped like its parameter
        return _is_sharded_state(located[idx][0], value) and (id(params[idx]), key) not in whole

    # Metadata of sharded tensors: (idx, key) -> dtype, union over ranks (one object collective).
    meta: dict[tuple[int, str], torch.dtype] = {}
    for idx, (handle, i) in enumerate(located):
        for key, value in local["state"].get(idx, {}).items():
            if cut(idx, key, value):
                assert (
                    handle is not None
                )  # the piece: the parameter's data between steps (not inside unshard_params)
                piece = handle.piece(i)
                if value.shape != piece.shape:
                    raise ValueError(
                        f"Optimizer {type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} "
                        f"for a parameter piece of shape {tuple(piece.shape)}; only elementwise optimizer "
                        "state can be consolidated. HINT: use an elementwise optimizer (Adam, AdamW, SGD...)."
                    )
                meta[(idx, key)] = value.dtype
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, meta)
        for other in everyone:
            meta.update(other)
    state: dict[int, dict[str, Any]] = {}
    if keep:
        for idx, entries in local["state"].items():
            handle = located[idx][0]
            state[idx] = {
                k: copy_out(v, to_cpu) if isinstance(v, torch.Tensor) else v
                for k, v in entries.items()
                if not cut(idx, k, v)
            }
    # Sharded tensors: one item per (unit, key), in a fixed order on every rank.
    by_unit: dict[int, tuple[FlatParamHandle, dict[str, list[int]]]] = {}
    for idx, key in sorted(meta, key=lambda t: (t[0], t[1])):
        handle = located[idx][0]
        assert handle is not None
        by_unit.setdefault(id(handle), (handle, {}))[1].setdefault(key, []).append(idx)
    items: list[GatherItem] = []
    placements: list[
        tuple[str, list[int], list[int]]
    ] = []  # per item: key, optimizer indices, layout indices
    for handle, keys in sorted(by_unit.values(), key=lambda hk: _unit_order(module, hk[0])):
        for key in sorted(keys):
            idxs = keys[key]
            pieces: list[tuple[int, torch.Tensor]] = []
            for idx in idxs:
                info = handle.shard_infos[located[idx][1]]
                value = local["state"].get(idx, {}).get(key)
                if value is not None and info.numel_in_shard:
                    pieces.append((info.offset_in_shard, value.detach().reshape(-1)))
            pieces.sort(key=lambda piece: piece[0])
            positions = [located[idx][1] for idx in idxs]
            items.append(
                GatherItem(
                    group=handle.shard_group,
                    device=handle.device,
                    layout=handle.layout,
                    dtype=meta[(idxs[0], key)],
                    wanted=positions,
                    pieces=pieces,
                    out_device=torch.device("cpu") if to_cpu else handle.sharded.device,
                    tensor_parallel=handle.tensor_parallel_of(positions),
                )
            )
            placements.append((key, idxs, positions))

    def assemble(results: list[dict[int, torch.Tensor]]) -> dict[str, Any]:
        if not keep:
            return {}
        for (key, idxs, positions), tensors in zip(placements, results, strict=True):
            for idx, pos in zip(idxs, positions, strict=True):
                state.setdefault(idx, {})[key] = tensors[pos]
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}

    return items, assemble


def _unit_order(module: nn.Module, handle: FlatParamHandle) -> int:
    for i, m in enumerate(module.modules()):
        state = m.__dict__.get("_flatshard_state")
        if state is not None and any(h is handle for h in state.handles):
            return i
    return -1


def convert_full_optim_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    source: str = "optimizer state",
    copy: bool = True,
) -> dict[str, Any]:
    """Validate a full (plain-format) optimizer state and cut out this rank's slices; changes nothing.

    Returns the state dict to pass to ``optimizer.load_state_dict``, its tensors private copies; with
    ``copy=False`` they are views of ``state_dict``'s, for :func:`load_converted_optim_state`.
    """
    prepare_for_state_io(module, "set_state_dict")
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{source} is not an optimizer state dict (needs 'state' and 'param_groups').")
    params = optimizer_params(optimizer)
    located = locate_params(params)
    saved_groups = state_dict["param_groups"]
    sizes_saved = [len(g["params"]) for g in saved_groups]
    sizes_now = [len(g["params"]) for g in optimizer.param_groups]
    if sizes_saved != sizes_now:
        raise ValueError(
            f"{source} has param groups of sizes {sizes_saved}, the optimizer {sizes_now}. HINT: build the "
            "optimizer with the same parameter groups as when the checkpoint was saved. Nothing was loaded."
        )
    saved_ids = [i for g in saved_groups for i in g["params"]]
    local_state: dict[int, dict[str, Any]] = {}
    whole_state = is_whole_tensor_optimizer(
        optimizer
    )  # state of other shapes is its own (Adafactor's factors)
    kept_whole: set[tuple[int, str]] = set()
    for pos, saved_id in enumerate(saved_ids):
        entries = state_dict["state"].get(saved_id)
        if entries is None:
            continue
        handle, i = located[pos]
        full_shape = handle.full_shape(i) if handle is not None else params[pos].shape
        converted: dict[str, Any] = {}
        for key, value in entries.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.shape != full_shape
                and whole_state
            ):
                kept_whole.add((id(params[pos]), key))  # whole, on the owner after the load
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != full_shape:
                    raise ValueError(
                        f"{source}: state {key!r} of parameter #{pos} has shape {tuple(value.shape)}, the parameter "
                        f"has {tuple(full_shape)}. HINT: the checkpoint belongs to another model. Nothing was loaded."
                    )
                if _is_sharded_state(handle, value):
                    assert handle is not None
                    value = handle.local_of_full(i, value)  # see [Note: tensor parallelism]
                    info = handle.shard_infos[i]
                    if handle.shard_world > 1:
                        value = value.reshape(-1)[
                            info.offset_in_param : info.offset_in_param + info.numel_in_shard
                        ]
            # Always a private copy: the optimizer updates state in place (``step`` included), and the
            # source may be another optimizer's live state or a memory-mapped file.
            converted[key] = value.clone() if copy and isinstance(value, torch.Tensor) else value
        local_state[pos] = converted
    note_loaded_whole(optimizer, kept_whole)
    offload_plan(optimizer)  # its load goes to host memory: see [Note: optimizer offload]
    groups = [
        dict(g, params=list(range(start, start + len(g["params"]))))
        for g, start in zip(saved_groups, _starts(sizes_saved), strict=False)
    ]
    return {"state": local_state, "param_groups": groups}


def load_converted_optim_state(
    optimizer: torch.optim.Optimizer,
    converted: dict[str, Any],
    after_copy: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Load what ``convert_full_optim_state_dict(..., copy=False)`` cut out (views of the source).

    Each tensor is copied into the optimizer's current state tensor of the same shape, dtype and device where
    there is one (an optimizer that has stepped: no new memory), else into a new one; ``after_copy`` is called
    with each source once copied (see [Note: reading a full file by byte ranges]).
    """
    params = optimizer_params(optimizer)
    for pos, entries in converted["state"].items():
        current = optimizer.state.get(params[pos], {})
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            old = current.get(key)
            if (
                isinstance(old, torch.Tensor)
                and old is not value
                and old.shape == value.shape
                and old.dtype == value.dtype
                and old.device == value.device
            ):
                entries[key] = old.copy_(value)
            else:
                entries[key] = value.clone()
            if after_copy is not None:
                after_copy(value)
    optimizer.load_state_dict(converted)
    after_load(optimizer)  # see [Note: saving whole-tensor optimizer state]


def _starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for n in sizes:
        out.append(acc)
        acc += n
    return out


def load_full_optim_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    source: str = "optimizer state",
) -> None:
    """Load a full (plain-format) optimizer state: each rank keeps its slices. Validates first."""
    optimizer.load_state_dict(convert_full_optim_state_dict(module, optimizer, state_dict, source))
    after_load(optimizer)
