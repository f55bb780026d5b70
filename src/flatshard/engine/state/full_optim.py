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

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.gather import GatherItem, gather_items
from flatshard.engine.handle import FlatParamHandle, handle_of_param
from flatshard.engine.shard import unit_states
from flatshard.engine.state_dict import copy_out, global_rank, prepare_for_state_io

__all__ = [
    "convert_full_optim_state_dict",
    "full_optim_state_dict",
    "load_full_optim_state_dict",
    "original_shapes",
    "parameter_names",
    "plan_full_optim_state_dict",
    "rebind_optimizer",
]


@contextmanager
def original_shapes(module: nn.Module) -> Iterator[None]:
    """Inside, every sharded parameter of ``module`` has its original shape (not its 1-D piece) and no values:
    its data is one element repeated by zero strides. For building an optimizer whose param groups depend
    on shapes after the model is sharded; ``rebind_optimizer`` then cuts any state it made to the pieces.
    """
    scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for handle in (state.handle for state in unit_states(module) if state.handle is not None):
            if handle.shard_world == 1:
                continue  # its pieces already have the full shapes
            for p, shape in zip(handle.params, handle.layout.shapes, strict=True):
                one = scratch.setdefault((p.dtype, p.device), torch.zeros(1, dtype=p.dtype, device=p.device))
                saved.append((p, p.data))
                p.data = one.as_strided(shape, (0,) * len(shape))
        yield
    finally:
        for p, data in saved:
            p.data = data


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of the module's parameters, to find them again with ``rebind_optimizer``."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str], module: nn.Module) -> None:
    """Fit an optimizer built before ``shard()`` to the sharded module.

    ``shard()`` keeps a module's ``Parameter`` objects, except those built on the meta device: materializing
    makes new ones. Each parameter the optimizer holds that was the module's (``names``, taken before
    sharding) and no longer is, is replaced by the module's parameter of the same name. State an optimizer
    created in its constructor (Adagrad's ``sum``) has the parameter's full shape; it is cut down to this
    rank's piece. Tensors that were never the module's are left alone. Raises ``ValueError`` (changing
    nothing) if a parameter cannot be found, or holds state although it was replaced.
    """
    now = dict(module.named_parameters(remove_duplicate=True))
    current = {id(p) for p in now.values()}
    replace: list[tuple[dict[str, Any], int, torch.Tensor, nn.Parameter]] = []
    for index, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in current or id(p) not in names:
                continue
            name = names[id(p)]
            if name not in now:
                raise ValueError(
                    f"{type(optimizer).__name__} param group {index} holds parameter {name!r}, which the model no "
                    "longer has after sharding. HINT: create the optimizer after sharding the model."
                )
            if optimizer.state.get(p):
                raise ValueError(
                    f"{type(optimizer).__name__} already holds state for parameter {name!r}, which sharding "
                    "replaced (it was built on the meta device). HINT: create the optimizer after sharding."
                )
            replace.append((group, i, p, now[name]))
    for group, i, old, new in replace:
        optimizer.state.pop(old, None)
        params = list(group["params"])
        params[i] = new
        group["params"] = params
    params = _ordered_params(optimizer)
    for p, (handle, index) in zip(params, _locate(params), strict=True):
        if handle is None or not optimizer.state.get(p):
            continue
        full_shape, info = handle.layout.shapes[index], handle.shard_infos[index]
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor) and value.shape == full_shape and value.shape != p.shape:
                start = info.offset_in_param
                piece = value.reshape(-1)[start : start + info.numel_in_shard]
                optimizer.state[p][key] = piece.to(p.device).clone().view(p.shape)


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_sharded_state(handle: FlatParamHandle | None, value: Any) -> bool:
    return (
        handle is not None and handle.shard_world > 1 and isinstance(value, torch.Tensor) and value.dim() > 0
    )


def _locate(params: list[torch.Tensor]) -> list[tuple[FlatParamHandle | None, int]]:
    out: list[tuple[FlatParamHandle | None, int]] = []
    for p in params:
        handle = handle_of_param(p)
        out.append((handle, -1 if handle is None else handle.index_of(p)))
    return out


def full_optim_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """Gather the full optimizer state (see [Note: optimizer state consolidation]). Run on all ranks."""
    keep = global_rank() == 0 or not rank0_only
    items, assemble = plan_full_optim_state_dict(module, optimizer, keep=keep, cpu_offload=cpu_offload)
    return assemble(gather_items(items, keep))


def plan_full_optim_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: bool,
    cpu_offload: bool,
) -> tuple[list[GatherItem], Callable[[list[dict[int, torch.Tensor]]], dict[str, Any]]]:
    """Agree on the state's metadata (all ranks); return what to gather and how to build the state."""
    prepare_for_state_io(module, "get_state_dict")
    params = _ordered_params(optimizer)
    located = _locate(params)
    local = optimizer.state_dict()
    # Metadata of sharded tensors: (idx, key) -> dtype, union over ranks (one object collective).
    meta: dict[tuple[int, str], torch.dtype] = {}
    for idx, (handle, _) in enumerate(located):
        for key, value in local["state"].get(idx, {}).items():
            if _is_sharded_state(handle, value):
                if value.shape != params[idx].shape:
                    raise ValueError(
                        f"Optimizer {type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} "
                        f"for a parameter piece of shape {tuple(params[idx].shape)}; only elementwise optimizer "
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
                k: copy_out(v, cpu_offload) if isinstance(v, torch.Tensor) else v
                for k, v in entries.items()
                if not _is_sharded_state(handle, v)
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
                    out_device=torch.device("cpu") if cpu_offload else handle.sharded.device,
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
        if state is not None and state.handle is handle:
            return i
    return -1


def convert_full_optim_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    source: str = "optimizer state",
) -> dict[str, Any]:
    """Validate a full (plain-format) optimizer state and cut out this rank's slices; changes nothing.

    Returns the state dict to pass to ``optimizer.load_state_dict``.
    """
    prepare_for_state_io(module, "set_state_dict")
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{source} is not an optimizer state dict (needs 'state' and 'param_groups').")
    params = _ordered_params(optimizer)
    located = _locate(params)
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
    for pos, saved_id in enumerate(saved_ids):
        entries = state_dict["state"].get(saved_id)
        if entries is None:
            continue
        handle, i = located[pos]
        full_shape = handle.layout.shapes[i] if handle is not None else params[pos].shape
        converted: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != full_shape:
                    raise ValueError(
                        f"{source}: state {key!r} of parameter #{pos} has shape {tuple(value.shape)}, the parameter "
                        f"has {tuple(full_shape)}. HINT: the checkpoint belongs to another model. Nothing was loaded."
                    )
                if _is_sharded_state(handle, value):
                    assert handle is not None
                    info = handle.shard_infos[i]
                    value = value.reshape(-1)[
                        info.offset_in_param : info.offset_in_param + info.numel_in_shard
                    ]
            # Always a private copy: the optimizer updates state in place (``step`` included), and the
            # source may be another optimizer's live state or a memory-mapped file.
            converted[key] = value.clone() if isinstance(value, torch.Tensor) else value
        local_state[pos] = converted
    groups = [
        dict(g, params=list(range(start, start + len(g["params"]))))
        for g, start in zip(saved_groups, _starts(sizes_saved), strict=False)
    ]
    return {"state": local_state, "param_groups": groups}


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
