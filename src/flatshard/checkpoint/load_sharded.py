"""Loading a sharded checkpoint directory into a sharded module on any world size.

Each rank reads only what it holds: its piece of every parameter it manages (see [Note: sharded checkpoint
layout] in ``flatshard.checkpoint.directory``) and whole tensors of what is replicated here. Everything is
validated (keys, shapes, optimizer groups) on every rank, and the ranks agree, before anything is applied.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.nn as nn

from flatshard.checkpoint.dcp_layout import Layout, Names, canonical, fill_pieces, find_pieces
from flatshard.checkpoint.directory import OBJECT, ShardedReader
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.storage import Location
from flatshard.checkpoint.validate import (
    agree_on_error,
    check_dtype_kinds,
    check_optimizer_count,
    check_required,
)
from flatshard.engine import (
    ParamShard,
    finish_optimizer_load,
    local_param_targets,
    param_shard,
    parameter_names,
    prepare_for_state_io,
    state_device,
    to_local_model_state,
    to_local_optim_state,
)

__all__ = ["load_sharded"]


def _model_targets(
    reader: ShardedReader, layout: Layout, module: nn.Module, strict: bool, allow_cast: bool
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """DCP targets for the model: fqn -> ParamShard / tensor / OBJECT, and fqn -> the state-dict keys it fills.

    Under ``strict``, the keys stored under the model's name that the model does not have are refused too (see
    :attr:`Layout.unclaimed`); a dtype of another kind than the model's is refused unless ``allow_cast``."""
    if not layout.model:
        where = "" if reader.version else " under any of the model's keys"
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} holds no model state{where} (its entries include "
            f"{sorted(reader.entries)[:6]}). HINT: pass a checkpoint of this model. Nothing was loaded."
        )
    own = module.state_dict(keep_vars=True)
    saved = layout.model
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    listed = set(unexpected)
    unexpected += [k for k in layout.unclaimed if k not in listed]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} does not match {type(module).__name__}: missing keys "
            f"{missing[:8]} ({len(missing)}), unexpected keys {unexpected[:8]} ({len(unexpected)}). HINT: load a "
            "checkpoint of the same model architecture, or pass strict=False (with the Trainer: self.strict_loading = "
            "False in the LightningModule). Nothing was loaded."
        )
    live = local_param_targets(module)
    targets: dict[str, Any] = {}
    keys: dict[str, list[str]] = {}
    problems = []
    kinds: list[tuple[str, torch.dtype, torch.dtype]] = []  # (fqn, stored, loads into)
    for key, value in own.items():
        if key not in saved:
            continue
        fqn = saved[key]
        if reader.is_object(fqn):
            targets[fqn] = OBJECT
            keys.setdefault(fqn, []).append(key)
            continue
        md = reader.tensor_meta(fqn)
        if md is None:
            problems.append(f"{key!r} has no data in the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a tensor in the checkpoint but not in the model")
            continue
        tensor, shard = live[key]
        full_shape = shard.shape if shard is not None else tensor.shape
        saved_shape = reader.full_shape(fqn)
        if saved_shape != full_shape:
            problems.append(
                f"{key!r} has shape {tuple(saved_shape)} in the checkpoint, {tuple(full_shape)} in the model"
            )
            continue
        if fqn not in targets:
            targets[fqn] = _target(reader, fqn, shard, full_shape, tensor.dtype, tensor.device)
            kinds.append((fqn, md.properties.dtype, tensor.dtype))
        keys.setdefault(fqn, []).append(key)
    if problems:
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} does not match {type(module).__name__}: {'; '.join(problems[:8])}"
            f"{' ...' if len(problems) > 8 else ''}. HINT: load a checkpoint of the same model architecture. "
            "Nothing was loaded."
        )
    check_dtype_kinds(f"{reader.path} (model)", kinds, allow_cast)
    return targets, keys


def _target(
    reader: ShardedReader,
    fqn: str,
    shard: ParamShard | None,
    full_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    """Where to read ``fqn``: this rank's piece (managed here) or the whole tensor (replicated here).

    A version 1 piece (stored flat) is read whole as a flat ParamShard; the reader cuts boxes either way.
    """
    if shard is not None:
        return ParamShard(
            torch.empty(shard.local.numel(), dtype=dtype, device=device),
            shard.offset,
            full_shape,
            shard.block,
        )
    if reader.is_piece(fqn):
        return ParamShard(torch.empty(full_shape.numel(), dtype=dtype, device=device), 0, full_shape)
    return torch.empty(full_shape, dtype=dtype, device=device)


def _finish_piece(value: Any, shard: ParamShard | None) -> Any:
    """A read target in the form this rank holds: its 1-D piece (managed here) or the whole tensor.

    A whole tensor of the parameter's full shape (the writer did not shard it) is cut to this rank's piece;
    anything else (``step``, buffers) is returned as read.
    """
    if isinstance(value, ParamShard):
        return value if shard is not None else value.local.view(value.shape)
    if (
        shard is not None
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.shape == shard.shape
    ):
        return shard.with_local(shard.cut(value))
    return value


def _optim_targets(
    reader: ShardedReader,
    module: nn.Module,
    state_entries: dict[str, tuple[str, str]],
    k: int,
    optimizer: torch.optim.Optimizer,
    strict: bool,
    allow_cast: bool,
) -> tuple[dict[str, Any], dict[str, tuple[str, str, ParamShard | None]]]:
    """DCP targets for optimizer ``k``'s state, and fqn -> (parameter name, state key, its shard). Under
    ``strict``, state of a parameter the optimizer does not have is refused; elementwise state of another dtype
    kind than its parameter's unless ``allow_cast``."""
    names = parameter_names(module)
    by_param: dict[str, list[tuple[str, str]]] = {}
    for fqn, (name, key) in state_entries.items():
        by_param.setdefault(canonical(name), []).append((fqn, key))
    if strict:
        _check_stray_state(reader, module, optimizer, k, by_param)
    targets: dict[str, Any] = {}
    where: dict[str, tuple[str, str, ParamShard | None]] = {}
    kinds: list[tuple[str, torch.dtype, torch.dtype]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                continue  # reported by to_local_optim_state's checks
            name = names[id(p)]
            shard = param_shard(p)
            full_shape = shard.shape if shard is not None else p.shape
            for fqn, key in by_param.get(canonical(name), []):
                where[fqn] = (name, key, shard)
                if reader.is_object(fqn):
                    targets[fqn] = OBJECT
                    continue
                md = reader.tensor_meta(fqn)
                assert md is not None
                elementwise = reader.is_piece(fqn) or (len(md.size) > 0 and md.size == full_shape)
                if reader.is_piece(fqn) and reader.full_shape(fqn) != full_shape:
                    raise CheckpointError(
                        f"Sharded checkpoint {reader.path}: optimizer #{k} state {key!r} of {name!r} has shape "
                        f"{tuple(reader.full_shape(fqn))}, the parameter {tuple(full_shape)}. HINT: the checkpoint "
                        "belongs to another model. Nothing was loaded."
                    )
                if elementwise:
                    device = state_device(p)  # host memory under cpu_offload="optimizer"
                    targets[fqn] = _target(reader, fqn, shard, full_shape, md.properties.dtype, device)
                    kinds.append((fqn, md.properties.dtype, p.dtype))
                else:
                    targets[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device="cpu")
    check_dtype_kinds(f"{reader.path} (optimizer #{k})", kinds, allow_cast)
    return targets, where


def _check_stray_state(
    reader: ShardedReader,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    k: int,
    by_param: dict[str, list[tuple[str, str]]],
) -> None:
    """Refuse state saved for a parameter the optimizer does not have (any of a tied parameter's names)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    own = {canonical(n) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}
    stray = sorted(fqn for name, entries in by_param.items() if name not in own for fqn, _ in entries)
    if stray:
        raise CheckpointError(
            f"Sharded checkpoint {reader.path}: optimizer #{k} state holds entries for parameters the optimizer "
            f"does not have: {stray[:8]} ({len(stray)} in all). HINT: load a checkpoint of the same model and "
            "optimizer, or pass strict=False to skip them (with the Trainer: self.strict_loading = False in the "
            "LightningModule). Nothing was loaded."
        )


def _own_groups(
    module: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], per_parameter: bool
) -> list[dict[str, Any]]:
    """Saved param groups in the optimizer's terms: another tool's parameter names (``_orig_mod.`` and such)
    renamed to the module's. Groups saved per parameter (torch's flattened layout keeps no grouping) are
    regrouped like the optimizer's, provided every parameter of a group was saved with the same
    hyper-parameters. Anything else is returned for validation to report."""
    names = parameter_names(module)
    own = {canonical(n): n for n in names.values()}
    renamed = [dict(g, params=[own.get(canonical(str(n)), n) for n in g["params"]]) for g in groups]
    if not per_parameter:
        return renamed
    live = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    fields_of: dict[Any, dict[str, Any]] = {}
    for g in renamed:
        for name in g["params"]:
            fields_of[name] = {k: v for k, v in g.items() if k != "params"}
    if sorted(map(str, fields_of)) != sorted(str(n) for g in live for n in g):
        return renamed
    regrouped = []
    for members in live:
        fields = [fields_of[n] for n in members]
        if not fields or not all(_same_fields(f, fields[0]) for f in fields[1:]):
            return renamed
        regrouped.append({**fields[0], "params": list(members)})
    return regrouped


def _same_fields(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _piece_targets(reader: ShardedReader, module: nn.Module, extra: dict[str, Any]) -> dict[str, Any]:
    """Targets for the pieces stored in the checkpoint's other entries (see [Note: DCP-native layout]): this
    rank's piece when the path ends in a key of a parameter of the same shape it shares, else the whole."""
    live = local_param_targets(module)
    targets: dict[str, Any] = {}
    for path, piece in find_pieces(extra):
        md = reader.piece_meta(piece)
        tensor, shard = live.get(path[-1], (None, None)) if path else (None, None)
        if shard is None or tuple(shard.shape) != tuple(md.size):
            shard = None
        device = tensor.device if tensor is not None else torch.device("cpu")
        targets[piece.fqn] = _target(reader, piece.fqn, shard, md.size, md.properties.dtype, device)
    return targets


def load_sharded(
    path: Location,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    with_optim: bool,
    required: Collection[str],
    names: Names | None = None,
    allow_dtype_kind_cast: bool = False,
) -> dict[str, Any]:
    """Load a sharded checkpoint directory (any layout, see [Note: DCP-native layout]) into ``module`` and
    ``optimizers``; every rank calls. ``names``: a Fabric state's names, tried first in a foreign layout.
    ``allow_dtype_kind_cast``: cast integer / bool / floating-point tensors into another of these kinds."""
    error: BaseException | None = None
    reader: ShardedReader | None = None
    layout = Layout(0, None)
    extra: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    model_keys: dict[str, list[str]] = {}
    optim_where: list[dict[str, tuple[str, str, ParamShard | None]]] = []
    groups: list[list[dict[str, Any]]] = []
    try:
        prepare_for_state_io(module, "load_checkpoint")
        reader = ShardedReader(path)
        layout = reader.layout(
            list(module.state_dict(keep_vars=True)), names, len(optimizers) if with_optim else None
        )
        targets, model_keys = _model_targets(reader, layout, module, strict, allow_dtype_kind_cast)
        if with_optim:
            check_optimizer_count(path, layout.num_optimizers, optimizers)
            for k, opt in enumerate(optimizers):
                groups_root, state_entries = layout.optimizers[k]
                saved = reader.param_groups(groups_root)
                groups.append(_own_groups(module, opt, saved, reader.per_parameter_groups(groups_root)))
                # validate the groups now (with empty state) so nothing is read for a mismatched optimizer
                to_local_optim_state(
                    module, opt, {"state": {}, "param_groups": groups[k]}, source=f"{path} (optimizer #{k})"
                )
                more, where = _optim_targets(
                    reader, module, state_entries, k, opt, strict, allow_dtype_kind_cast
                )
                targets.update(more)
                optim_where.append(where)
        extra = reader.read_extra(layout)
        targets.update(_piece_targets(reader, module, extra))
    except (CheckpointError, FileNotFoundError) as err:
        error = err
    except ValueError as err:
        error = CheckpointError(str(err))
    agree_on_error(error)
    assert reader is not None
    objects = reader.read(targets)
    live = local_param_targets(module)
    extra = fill_pieces(
        extra,
        {
            p.fqn: _finish_piece(targets[p.fqn], live.get(path[-1], (None, None))[1])
            for path, p in find_pieces(extra)
        },
    )
    check_required(path, extra, required)
    # Apply: every value is in memory and checked; from here on nothing can fail for a data reason.
    model_state: dict[str, Any] = {}
    for fqn, fills in model_keys.items():
        for key in fills:
            if targets[fqn] is OBJECT:
                model_state[key] = objects[fqn]
            else:
                model_state[key] = _finish_piece(targets[fqn], live[key][1])
    with torch.no_grad():
        module.load_state_dict(to_local_model_state(module, model_state), strict=False)
    for k, opt in enumerate(optimizers if with_optim else []):
        state: dict[str, dict[str, Any]] = {}
        for fqn, (name, key, shard) in optim_where[k].items():
            value = objects[fqn] if targets[fqn] is OBJECT else _finish_piece(targets[fqn], shard)
            state.setdefault(name, {})[key] = value
        opt.load_state_dict(
            to_local_optim_state(
                module, opt, {"state": state, "param_groups": groups[k]}, source=f"{path}", copy=False
            )
        )
        finish_optimizer_load(opt)  # whole on the owners again: [Note: saving whole-tensor optimizer state]
    return extra
