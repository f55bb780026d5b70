"""``consolidate``: a sharded checkpoint directory to one full file, offline (no process group)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from flatshard.checkpoint.directory import OBJECT, ShardedReader
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.export import export_safetensors
from flatshard.checkpoint.files import atomic_save
from flatshard.checkpoint.storage import Remote, locate_checked
from flatshard.engine import ParamShard

__all__ = ["consolidate"]


def consolidate(src: str | os.PathLike[str] | Remote, out: str | os.PathLike[str] | Remote) -> Path | str:
    """Turn a sharded checkpoint directory into one full checkpoint file (no process group needed).

    The result is exactly what ``state_dict_type="full"`` would have written: a plain Lightning
    checkpoint whose optimizer states are in the plain optimizers' format. ``src`` and ``out`` are local
    paths or fsspec URLs; returns ``out`` (the URL for a URL). An ``out`` ending in ``.safetensors`` gets
    the model weights only, as :func:`~flatshard.checkpoint.export_safetensors` writes them.
    """
    if str(out).lower().endswith(".safetensors"):  # never a torch pickle under that name
        return export_safetensors(src, out).path
    target = locate_checked(out)  # an unreachable destination fails before anything is read
    reader = ShardedReader(src)
    layout = reader.layout()
    if layout.model is None and not layout.optimizers:
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} holds no model or optimizer state that flatshard recognises (its "
            f"entries include {sorted(reader.entries)[:6]}). HINT: pass a directory written by flatshard, "
            "Lightning's FSDP or ModelParallel strategies, or torch FSDP with a 'model' entry."
        )
    targets: dict[str, Any] = {}
    wanted = list((layout.model or {}).values())
    for _, state_entries in layout.optimizers:
        wanted += list(state_entries)
    for fqn in dict.fromkeys(wanted):
        md = reader.tensor_meta(fqn)
        if md is None:
            targets[fqn] = OBJECT
        elif reader.is_piece(fqn):  # format version 1: stored flat
            targets[fqn] = ParamShard(
                torch.empty(md.size, dtype=md.properties.dtype), 0, reader.full_shape(fqn)
            )
        else:
            targets[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
    objects = reader.read(targets)

    def value(fqn: str) -> Any:
        t = targets[fqn]
        if t is OBJECT:
            return objects[fqn]
        return t.local.view(t.shape) if isinstance(t, ParamShard) else t

    checkpoint: dict[str, Any] = reader.with_whole_pieces(reader.read_extra(layout))
    if layout.model is not None:
        checkpoint["state_dict"] = {k: value(fqn) for k, fqn in layout.model.items()}
    if layout.num_optimizers is not None:
        states = []
        for groups_root, entries in layout.optimizers:
            groups = reader.param_groups(groups_root)
            order = [name for g in groups for name in g["params"]]
            index = {name: i for i, name in enumerate(order)}
            state: dict[int, dict[str, Any]] = {}
            for fqn, (name, key) in entries.items():
                if name in index:
                    state.setdefault(index[name], {})[key] = value(fqn)
            start, plain_groups = 0, []
            for g in groups:
                plain_groups.append(dict(g, params=list(range(start, start + len(g["params"])))))
                start += len(g["params"])
            states.append({"state": dict(sorted(state.items())), "param_groups": plain_groups})
        checkpoint["optimizer_states"] = states
    return atomic_save(checkpoint, target)
