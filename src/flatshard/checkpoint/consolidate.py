"""``consolidate``: a sharded checkpoint directory to one full file, offline (no process group).

The tensors are read in batches of about ``BATCH_BYTES`` and each is written into the file as soon as it is read
(see [Note: a torch.save file written as it streams]); the dict, holding the records' stand-ins, is pickled
last. The process holds one batch of tensors at a time, whatever the checkpoint's size, and the file is the one
``torch.save`` writes for the same dict (one record per tensor read, so names that share an entry share it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from flatshard.checkpoint.dcp_layout import Layout
from flatshard.checkpoint.directory import OBJECT, ShardedReader
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.export import export_safetensors, is_directory_output
from flatshard.checkpoint.export_pretrained import export_pretrained
from flatshard.checkpoint.files import write_offline
from flatshard.checkpoint.storage import Remote, locate_checked
from flatshard.checkpoint.stream_file import StreamedTorchFile
from flatshard.engine import ParamShard

__all__ = ["BATCH_BYTES", "consolidate"]

BATCH_BYTES = 256 * 2**20  # tensors read from the directory at a time


def consolidate(src: str | os.PathLike[str] | Remote, out: str | os.PathLike[str] | Remote) -> Path | str:
    """Turn a sharded checkpoint directory into one full checkpoint file (no process group needed).

    The result is exactly what ``state_dict_type="full"`` would have written: a plain Lightning
    checkpoint whose optimizer states are in the plain optimizers' format. ``src`` and ``out`` are local
    paths or fsspec URLs; returns ``out`` (the URL for a URL). An ``out`` ending in ``.safetensors`` gets
    the model weights only, as :func:`~flatshard.checkpoint.export_safetensors` writes them; an ``out`` ending in
    ``/`` (or an existing directory) the weights as a Hugging Face model directory, as
    :func:`~flatshard.checkpoint.export_pretrained` writes them. For those two, ``src`` may be a full file too.
    """
    if str(out).lower().endswith(".safetensors"):  # never a torch pickle under that name
        return export_safetensors(src, out).path
    if is_directory_output(out):
        return export_pretrained(src, out).path
    target = locate_checked(out)  # an unreachable destination fails before anything is read
    reader = ShardedReader(src)
    layout = reader.layout()
    if layout.model is None and not layout.optimizers:
        raise CheckpointError(
            f"Sharded checkpoint {reader.path} holds no model or optimizer state that flatshard recognises (its "
            f"entries include {sorted(reader.entries)[:6]}). HINT: pass a directory written by flatshard, "
            "Lightning's FSDP or ModelParallel strategies, or torch FSDP with a 'model' entry."
        )
    wanted = list((layout.model or {}).values())
    for _, state_entries in layout.optimizers:
        wanted += list(state_entries)
    fqns = list(dict.fromkeys(wanted))
    object_fqns = [fqn for fqn in fqns if reader.tensor_meta(fqn) is None]
    objects = reader.read(dict.fromkeys(object_fqns, OBJECT)) if object_fqns else {}
    checkpoint: dict[str, Any] = reader.with_whole_pieces(reader.read_extra(layout))

    def write(f: Any) -> None:
        file = StreamedTorchFile(f)
        try:
            records = _stream_tensors(reader, [fqn for fqn in fqns if fqn not in object_fqns], file)
            file.finish(_assemble(reader, layout, checkpoint, {**objects, **records}))
        finally:
            with contextlib.suppress(Exception):  # closed by finish(); after a failure, what it raised counts
                file.close()

    return write_offline(target, write)


def _stream_tensors(reader: ShardedReader, fqns: list[str], file: StreamedTorchFile) -> dict[str, Any]:
    """Read the tensor entries ``fqns`` in batches of about ``BATCH_BYTES``, each written to ``file`` at once;
    returns each entry's stand-in."""
    records: dict[str, Any] = {}
    batch: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        nonlocal batch, size
        reader.read(batch)
        for fqn, t in batch.items():
            records[fqn] = file.tensor(t.local.view(t.shape) if isinstance(t, ParamShard) else t)
        batch, size = {}, 0

    for fqn in fqns:
        md = reader.tensor_meta(fqn)
        assert md is not None
        flat = torch.empty(md.size, dtype=md.properties.dtype)
        batch[fqn] = ParamShard(flat, 0, reader.full_shape(fqn)) if reader.is_piece(fqn) else flat  # v1: flat
        size += flat.numel() * flat.element_size()
        if size >= BATCH_BYTES:
            flush()
    if batch:
        flush()
    return records


def _assemble(
    reader: ShardedReader, layout: Layout, checkpoint: dict[str, Any], values: dict[str, Any]
) -> dict[str, Any]:
    """The full checkpoint dict from the directory's layout, with ``values`` (by entry) in place."""

    def value(fqn: str) -> Any:
        return values[fqn]

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
    return checkpoint
