"""Loading a checkpoint into a sharded module (and its optimizers) on any world size and wrap policy.

:func:`load_into` tells the format from what is on disk (a full file, or a sharded directory: see
``flatshard.checkpoint.load_sharded``) and validates everything (keys, shapes, optimizer groups, truncated or
missing files, format version) on every rank, with the ranks agreeing, before anything changes.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from flatshard.checkpoint.dcp_layout import Names
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.files import load_checkpoint_file
from flatshard.checkpoint.load_sharded import load_sharded
from flatshard.checkpoint.mapped import MappedPages
from flatshard.checkpoint.storage import Location, Remote, locate_checked, remote_kind
from flatshard.checkpoint.validate import (
    agree_on_error,
    check_optim_state_kinds,
    check_optimizer_count,
    check_required,
    check_state_dict_kinds,
)
from flatshard.engine import (
    check_full_model_state_dict,
    convert_full_optim_state_dict,
    is_sharded,
    load_converted_optim_state,
    load_full_model_state_dict,
    optimizer_list,
)

__all__ = ["load_checkpoint", "load_full_entries", "load_into"]

# What an entry of a full file loads into: a module, or an optimizer with the sharded module owning its parameters.
Target = nn.Module | tuple[torch.optim.Optimizer, nn.Module]


def load_checkpoint(
    path: str | os.PathLike[str] | Remote,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    strict: bool = True,
    allow_dtype_kind_cast: bool = False,
) -> dict[str, Any]:
    """Load a full file or sharded directory (a local path or an fsspec URL) into ``module`` (and optimizers)
    on any world size.

    Call on every rank. Returns the checkpoint's other entries (without ``state_dict`` and
    ``optimizer_states``). Raises :class:`CheckpointError` naming the file before anything changes if the
    checkpoint is damaged or does not fit.

    Args:
        strict: refuse keys the model (or, in a directory, the optimizer) does not have, and keys it lacks.
            Default: ``True``.
        allow_dtype_kind_cast: load a tensor stored as an integer into a floating-point parameter or the
            reverse (bool likewise), cast. A cast within a kind (float32 into bfloat16) always loads.
            Default: ``False`` (refused, naming the key and both dtypes).
    """
    optimizers = optimizer_list(optimizer)
    return load_into(
        path,
        module,
        optimizers,
        strict=strict,
        load_optimizer_states=bool(optimizers),
        allow_dtype_kind_cast=allow_dtype_kind_cast,
    )


def load_into(
    path: str | os.PathLike[str] | Remote,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool = True,
    load_optimizer_states: bool = True,
    weights_only: bool | None = None,
    required: Collection[str] = (),
    names: Names | None = None,
    allow_dtype_kind_cast: bool = False,
) -> dict[str, Any]:
    """The loader behind the strategies: dispatch on the format, validate everything, then apply.

    Returns the checkpoint dict without ``state_dict`` / ``optimizer_states``. Entries named in
    ``required`` must be in it: a ``KeyError`` before anything is applied otherwise. ``names``: the names a
    Fabric state gives the model and optimizers, tried first in another tool's sharded checkpoint.
    ``allow_dtype_kind_cast``: see :func:`load_checkpoint`.
    """
    location = locate_checked(path)  # a URL: every rank reaches its storage, or every rank raises
    if _is_directory(location):
        return load_sharded(
            location,
            module,
            optimizers,
            strict,
            load_optimizer_states,
            required,
            names,
            allow_dtype_kind_cast,
        )
    return _load_full(
        location,
        module,
        optimizers,
        strict,
        load_optimizer_states,
        weights_only,
        required,
        allow_dtype_kind_cast,
    )


def _is_directory(location: Location) -> bool:
    """A sharded checkpoint, complete or not (so that loading names what is missing), or a local one that an
    interrupted save left aside."""
    if isinstance(location, Remote):
        return remote_kind(location) in ("sharded", "incomplete")
    old = location.parent / f".{location.name}.flatshard-old"
    return location.is_dir() or (not location.exists() and old.is_dir())


def _load_full(
    path: Location,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    with_optim: bool,
    weights_only: bool | None,
    required: Collection[str],
    allow_cast: bool,
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
            check_optimizer_count(path, None if states is None else len(states), optimizers)
        check_full_model_state_dict(module, checkpoint["state_dict"], strict=strict, source=str(path))
        check_state_dict_kinds(path, module, checkpoint["state_dict"], allow_cast)
        if with_optim:
            pairs = list(enumerate(zip(optimizers, checkpoint["optimizer_states"], strict=True)))
            local_optim = [
                convert_full_optim_state_dict(module, opt, st, source=f"{path} (optimizer #{i})", copy=False)
                for i, (opt, st) in pairs
            ]
            for i, (opt, st) in pairs:
                check_optim_state_kinds(f"{path} (optimizer #{i})", opt, st, allow_cast)
    except (CheckpointError, FileNotFoundError) as err:
        error = err
    except ValueError as err:
        error = CheckpointError(str(err))
    agree_on_error(error)
    extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    check_required(path, extra, required)
    pages = _pages(path)  # see [Note: reading a full file by byte ranges]
    load_full_model_state_dict(
        module, checkpoint["state_dict"], strict=strict, source=str(path), after_copy=pages.release
    )
    for opt, local in zip(optimizers, local_optim):
        load_converted_optim_state(opt, local, after_copy=pages.release)
    return extra


def _pages(location: Location) -> MappedPages:
    """Where a local full file is mapped (to give back the pages read); nothing for one read from a URL."""
    return MappedPages(None if isinstance(location, Remote) else location)


def load_full_entries(
    path: str | os.PathLike[str] | Remote,
    targets: Mapping[str | None, Target],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    required: Collection[str] = (),
    allow_dtype_kind_cast: bool = False,
) -> dict[str, Any]:
    """Load the entries of a full file named in ``targets`` into their modules and optimizers (Fabric's
    ``fabric.load``); all ranks call. The key ``None`` means the whole file is that target's state.

    Everything is read and validated on every rank first (keys, shapes, optimizer groups, dtype kinds,
    ``required`` entries), the ranks agree (one rank's failure raises on every rank, as :func:`load_into`
    does), then it is applied. Returns the file's other entries (all of it when ``targets`` is empty)."""
    location = locate_checked(path)
    error: BaseException | None = None
    checkpoint: dict[str, Any] = {}
    converted: dict[str | None, dict[str, Any]] = {}
    try:
        checkpoint = load_checkpoint_file(location, weights_only=weights_only)
        check_required(location, checkpoint, required)
        for name, target in targets.items():
            state = checkpoint if name is None else checkpoint.get(name)
            if state is None:
                continue
            where = str(location) if name is None else f"{location} [{name!r}]"
            if isinstance(target, tuple):
                optimizer, owner = target
                converted[name] = convert_full_optim_state_dict(
                    owner, optimizer, state, source=where, copy=False
                )
                check_optim_state_kinds(where, optimizer, state, allow_dtype_kind_cast)
            elif is_sharded(target):
                check_full_model_state_dict(target, state, strict=strict, source=where)
                check_state_dict_kinds(where, target, state, allow_dtype_kind_cast)
    except (CheckpointError, FileNotFoundError, KeyError) as err:
        error = err
    except ValueError as err:
        error = CheckpointError(str(err))
    agree_on_error(error)
    pages = _pages(location)
    for name, target in targets.items():
        state = checkpoint if name is None else checkpoint.get(name)
        if state is None:
            continue
        if isinstance(target, tuple):
            load_converted_optim_state(target[0], converted[name], after_copy=pages.release)
        elif is_sharded(target):
            load_full_model_state_dict(
                target, state, strict=strict, source=str(location), after_copy=pages.release
            )
        else:
            target.load_state_dict(state, strict=strict)
    if None in targets:
        return {}
    return {k: v for k, v in checkpoint.items() if k not in targets}
