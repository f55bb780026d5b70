"""Checkpoint files and directories for sharded modules: save, load (any world size), consolidate.

Two formats, told apart by what is on disk:

- **full**: one ``torch.save`` file, a plain Lightning checkpoint (``state_dict``, ``optimizer_states`` in
  the plain optimizers' format, plus whatever else the checkpoint dict holds). Written by rank 0.
- **sharded**: a ``torch.distributed.checkpoint`` directory, written by every rank without tensor
  communication (see ``flatshard/checkpoint/sharded.py``).

Both load into a sharded module on any world size and wrap policy, and both are validated completely
(keys, shapes, optimizer groups, truncated or missing files, format version) before anything changes.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.checkpoint.files import CheckpointError, atomic_save, load_checkpoint_file
from flatshard.checkpoint.sharded import (
    OBJECT,
    ShardedReader,
    is_sharded_checkpoint,
    write_sharded_checkpoint,
)
from flatshard.engine.api import get_state_dict, optimizer_list
from flatshard.engine.handle import handle_of_param
from flatshard.engine.optim_state import convert_full_optim_state_dict
from flatshard.engine.sharded_state import (
    ParamShard,
    local_param_targets,
    param_names,
    sharded_model_state_dict,
    sharded_optim_state_dict,
    to_local_model_state,
    to_local_optim_state,
)
from flatshard.engine.state_dict import (
    check_full_model_state_dict,
    load_full_model_state_dict,
    prepare_for_state_io,
)

__all__ = [
    "CheckpointError",
    "consolidate",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_into",
    "save_checkpoint",
]

StateDictType = Literal["full", "sharded"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    state_dict_type: StateDictType = "full",
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``module`` (and optimizers) to ``path``; call it on every rank.

    Args:
        path: a file (``"full"``) or a directory (``"sharded"``).
        module: a module sharded with ``flatshard.shard``.
        optimizer: an optimizer, a list of them, or ``None``.
        state_dict_type: ``"full"`` (one consolidated file from rank 0) or ``"sharded"`` (every rank writes
            its pieces; no gathering).
        extra: more entries for the checkpoint dict (epoch, scheduler state...); loaded back by
            :func:`load_checkpoint`.
    """
    checkpoint = dict(extra or {})
    optimizers = optimizer_list(optimizer)
    if state_dict_type == "full":
        model_state, optim_states = get_state_dict(module, optimizers, rank0_only=True, cpu_offload=True)
        checkpoint["state_dict"] = model_state
        if optimizers:
            checkpoint["optimizer_states"] = optim_states
        if _rank() == 0:
            atomic_save(checkpoint, path)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return Path(path)
    if state_dict_type == "sharded":
        checkpoint["state_dict"] = sharded_model_state_dict(module)
        if optimizers:
            checkpoint["optimizer_states"] = [sharded_optim_state_dict(module, o) for o in optimizers]
        return write_sharded_checkpoint(checkpoint, path)
    raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")


def load_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a full file or sharded directory into ``module`` (and optimizers) on any world size.

    Call on every rank. Returns the checkpoint's other entries (without ``state_dict`` and
    ``optimizer_states``). Raises :class:`CheckpointError` naming the file before anything changes if the
    checkpoint is damaged or does not fit.
    """
    optimizers = optimizer_list(optimizer)
    return load_into(path, module, optimizers, strict=strict, load_optimizer_states=bool(optimizers))


def load_into(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool = True,
    load_optimizer_states: bool = True,
    weights_only: bool | None = None,
    required: Collection[str] = (),
) -> dict[str, Any]:
    """The loader behind the strategies: dispatch on the format, validate everything, then apply.

    Returns the checkpoint dict without ``state_dict`` / ``optimizer_states``. Entries named in
    ``required`` must be in it: a ``KeyError`` before anything is applied otherwise.
    """
    if Path(path).is_dir() or (
        not Path(path).exists() and Path(path).parent.joinpath(f".{Path(path).name}.flatshard-old").is_dir()
    ):
        return _load_sharded(Path(path), module, optimizers, strict, load_optimizer_states, required)
    return _load_full(Path(path), module, optimizers, strict, load_optimizer_states, weights_only, required)


def check_required(path: str | os.PathLike[str], extra: Mapping[str, Any], required: Collection[str]) -> None:
    """Raise before anything is applied if the checkpoint lacks an entry the caller needs (every rank reads
    the same checkpoint, so every rank raises alike)."""
    missing = [k for k in required if k not in extra]
    if missing:
        raise KeyError(
            f"Checkpoint {path} has no entries {missing}; nothing was loaded. HINT: pass strict=False to skip "
            "them."
        )


def _agree(error: BaseException | None) -> None:
    """Raise on every rank if validation failed on any, so no rank goes on to read alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"Loading failed on rank {rank}: {message}")


def _check_optimizer_count(path: Path, saved: int | None, optimizers: Sequence[Any]) -> None:
    if saved is None:
        raise CheckpointError(
            f"Checkpoint {path} holds only the model (no optimizer states), so training cannot resume from it. "
            "HINT: it was probably saved with save_weights_only=True; load it for inference, or load weights "
            "only with flatshard.load_checkpoint(path, module)."
        )
    if saved != len(optimizers):
        raise CheckpointError(
            f"Checkpoint {path} holds {saved} optimizer states but {len(optimizers)} optimizers were given. HINT: "
            "resume with the same optimizers (configure_optimizers) as when it was saved."
        )


# ---------------------------------------------------------------------------------------------- full files
def _load_full(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    with_optim: bool,
    weights_only: bool | None,
    required: Collection[str],
) -> dict[str, Any]:
    error: BaseException | None = None
    checkpoint: dict[str, Any] = {}
    local_optim: list[dict[str, Any]] = []
    try:
        checkpoint = load_checkpoint_file(path, weights_only=weights_only)
        if "state_dict" not in checkpoint:
            raise CheckpointError(
                f"Checkpoint {path} has no 'state_dict' entry (keys: {sorted(checkpoint)[:8]}). HINT: pass a "
                "checkpoint written by Trainer.save_checkpoint or flatshard.save_checkpoint."
            )
        if with_optim:
            states = checkpoint.get("optimizer_states")
            _check_optimizer_count(path, None if states is None else len(states), optimizers)
        check_full_model_state_dict(module, checkpoint["state_dict"], strict=strict, source=str(path))
        if with_optim:
            local_optim = [
                convert_full_optim_state_dict(module, opt, st, source=f"{path} (optimizer #{i})")
                for i, (opt, st) in enumerate(zip(optimizers, checkpoint["optimizer_states"], strict=True))
            ]
    except (CheckpointError, FileNotFoundError) as err:
        error = err
    except ValueError as err:
        error = CheckpointError(str(err))
    _agree(error)
    extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    check_required(path, extra, required)
    load_full_model_state_dict(module, checkpoint["state_dict"], strict=strict, source=str(path))
    for opt, local in zip(optimizers, local_optim):
        opt.load_state_dict(local)
    return extra


# ---------------------------------------------------------------------------------------------- sharded
def _model_targets(
    reader: ShardedReader, module: nn.Module, strict: bool
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """DCP targets for the model: fqn -> ParamShard / tensor / OBJECT, and fqn -> the state-dict keys it fills."""
    meta = reader.meta
    saved_keys = meta.get("model_keys")
    if saved_keys is None:
        raise CheckpointError(f"Sharded checkpoint {reader.path} holds no model state ('state_dict').")
    aliases: dict[str, str] = meta.get("aliases", {})
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in set(saved_keys)]
    unexpected = [k for k in saved_keys if k not in own]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} does not match {type(module).__name__}: missing keys "
            f"{missing[:8]} ({len(missing)}), unexpected keys {unexpected[:8]} ({len(unexpected)}). HINT: load a "
            "checkpoint of the same model architecture, or pass strict=False. Nothing was loaded."
        )
    live = local_param_targets(module)
    targets: dict[str, Any] = {}
    keys: dict[str, list[str]] = {}
    problems = []
    for key, value in own.items():
        if key not in set(saved_keys):
            continue
        fqn = "model/" + aliases.get(key, key)
        if reader.is_object(fqn):
            targets[fqn] = OBJECT
            keys.setdefault(fqn, []).append(key)
            continue
        if reader.tensor_meta(fqn) is None:
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
        keys.setdefault(fqn, []).append(key)
    if problems:
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} does not match {type(module).__name__}: {'; '.join(problems[:8])}"
            f"{' ...' if len(problems) > 8 else ''}. HINT: load a checkpoint of the same model architecture. "
            "Nothing was loaded."
        )
    return targets, keys


def _target(
    reader: ShardedReader,
    fqn: str,
    shard: ParamShard | None,
    full_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    """Where to read ``fqn``: this rank's piece (managed here) or the whole tensor (replicated here)."""
    numel = 1
    for d in full_shape:
        numel *= d
    if reader.is_piece(fqn):
        if shard is not None:
            return ParamShard(
                torch.empty(shard.local.numel(), dtype=dtype, device=device), shard.offset, full_shape
            )
        return ParamShard(torch.empty(numel, dtype=dtype, device=device), 0, full_shape)
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
        flat = value.reshape(-1)[shard.offset : shard.offset + shard.local.numel()]
        return ParamShard(flat, shard.offset, shard.shape)
    return value


def _optim_targets(
    reader: ShardedReader,
    module: nn.Module,
    k: int,
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, tuple[str, str, ParamShard | None]]]:
    names = param_names(module)
    prefix = f"optim/{k}/state/"
    by_param: dict[str, list[str]] = {}
    for fqn in reader.keys_with_prefix(prefix):
        owner = fqn[len(prefix) :].rpartition("/")[0]
        by_param.setdefault(owner, []).append(fqn)
    targets: dict[str, Any] = {}
    where: dict[str, tuple[str, str, ParamShard | None]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                continue  # reported by to_local_optim_state's checks
            name = names[id(p)]
            handle = handle_of_param(p)
            shard = None
            if handle is not None:
                i = handle.index_of(p)
                info = handle.shard_infos[i]
                shard = ParamShard(p.detach().reshape(-1), info.offset_in_param, handle.layout.shapes[i])
            full_shape = shard.shape if shard is not None else p.shape
            for fqn in by_param.get(name, []):
                key = fqn[len(prefix) + len(name) + 1 :]
                where[fqn] = (name, key, shard)
                if reader.is_object(fqn):
                    targets[fqn] = OBJECT
                    continue
                md = reader.tensor_meta(fqn)
                assert md is not None
                if reader.is_piece(fqn):
                    if reader.full_shape(fqn) != full_shape:
                        raise CheckpointError(
                            f"Sharded checkpoint {reader.path}: optimizer #{k} state {key!r} of {name!r} has shape "
                            f"{tuple(reader.full_shape(fqn))}, the parameter {tuple(full_shape)}. HINT: the checkpoint "
                            "belongs to another model. Nothing was loaded."
                        )
                    targets[fqn] = _target(reader, fqn, shard, full_shape, md.properties.dtype, p.device)
                else:
                    targets[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device="cpu")
    return targets, where


def _load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    with_optim: bool,
    required: Collection[str],
) -> dict[str, Any]:
    error: BaseException | None = None
    reader: ShardedReader | None = None
    targets: dict[str, Any] = {}
    model_keys: dict[str, list[str]] = {}
    optim_where: list[dict[str, tuple[str, str, ParamShard | None]]] = []
    groups: list[list[dict[str, Any]]] = []
    try:
        prepare_for_state_io(module, "load_checkpoint")
        reader = ShardedReader(path)
        targets, model_keys = _model_targets(reader, module, strict)
        if with_optim:
            _check_optimizer_count(path, reader.meta.get("num_optimizers"), optimizers)
            saved_groups = reader.read_objects([f"optim/{k}/groups" for k in range(len(optimizers))])
            for k, opt in enumerate(optimizers):
                groups.append(saved_groups[f"optim/{k}/groups"])
                # validate the groups now (with empty state) so nothing is read for a mismatched optimizer
                to_local_optim_state(
                    module, opt, {"state": {}, "param_groups": groups[k]}, source=f"{path} (optimizer #{k})"
                )
                more, where = _optim_targets(reader, module, k, opt, groups[k])
                targets.update(more)
                optim_where.append(where)
        targets["extra"] = OBJECT
    except (CheckpointError, FileNotFoundError) as err:
        error = err
    except ValueError as err:
        error = CheckpointError(str(err))
    _agree(error)
    assert reader is not None
    objects = reader.read(targets)
    extra = objects.get("extra", {})
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    check_required(path, extra, required)
    # Apply: every value is in memory and checked; from here on nothing can fail for a data reason.
    live = local_param_targets(module)
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
    return extra


# ---------------------------------------------------------------------------------------------- consolidate
def consolidate(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Turn a sharded checkpoint directory into one full checkpoint file (no process group needed).

    The result is exactly what ``state_dict_type="full"`` would have written: a plain Lightning
    checkpoint whose optimizer states are in the plain optimizers' format.
    """
    reader = ShardedReader(src)
    meta = reader.meta
    targets: dict[str, Any] = {"extra": OBJECT}
    for fqn in reader.entries:
        if fqn.startswith(("model/", "optim/")):
            if reader.is_object(fqn):
                targets[fqn] = OBJECT
            elif reader.is_piece(fqn):
                md = reader.tensor_meta(fqn)
                assert md is not None
                shape = reader.full_shape(fqn)
                targets[fqn] = ParamShard(torch.empty(md.size, dtype=md.properties.dtype), 0, shape)
            else:
                md = reader.tensor_meta(fqn)
                assert md is not None
                targets[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
    objects = reader.read(targets)

    def value(fqn: str) -> Any:
        t = targets[fqn]
        if t is OBJECT:
            return objects[fqn]
        return t.local.view(t.shape) if isinstance(t, ParamShard) else t

    checkpoint: dict[str, Any] = dict(objects.get("extra") or {})
    if meta.get("model_keys") is not None:
        aliases = meta.get("aliases", {})
        checkpoint["state_dict"] = {k: value("model/" + aliases.get(k, k)) for k in meta["model_keys"]}
    if meta.get("num_optimizers") is not None:
        states = []
        for k in range(meta["num_optimizers"]):
            groups = objects[f"optim/{k}/groups"]
            order = [name for g in groups for name in g["params"]]
            index = {name: i for i, name in enumerate(order)}
            prefix = f"optim/{k}/state/"
            state: dict[int, dict[str, Any]] = {}
            for fqn in targets:
                if fqn.startswith(prefix):
                    name, _, key = fqn[len(prefix) :].rpartition("/")
                    state.setdefault(index[name], {})[key] = value(fqn)
            start, plain_groups = 0, []
            for g in groups:
                plain_groups.append(dict(g, params=list(range(start, start + len(g["params"])))))
                start += len(g["params"])
            states.append({"state": dict(sorted(state.items())), "param_groups": plain_groups})
        checkpoint["optimizer_states"] = states
    return atomic_save(checkpoint, out)
