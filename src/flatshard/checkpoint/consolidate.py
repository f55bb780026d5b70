"""``consolidate``: a sharded checkpoint directory to one full file, offline (no process group)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from flatshard.checkpoint.export import export_safetensors
from flatshard.checkpoint.files import atomic_save
from flatshard.checkpoint.sharded import OBJECT, ShardedReader
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
    return atomic_save(checkpoint, target)
