"""``export_pretrained``: a checkpoint's model weights as a Hugging Face model directory, offline.

The checkpoint (a full file or a sharded directory) is read as :func:`~flatshard.checkpoint.export_safetensors`
reads it (see [Note: safetensors export]: the prefix, the EMA weights, tied names once) and written in Hugging
Face's multi-file layout (see [Note: Hugging Face model directory]): the files are planned from the metadata
before any tensor is read, and each tensor is written as it is read (a sharded directory in batches of about
256 MiB, a full file's pages given back once written), so the export holds about one batch in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.export import (
    PROGRESS_MIN_BYTES,
    Progress,
    open_entries,
    read_tensors,
)
from flatshard.checkpoint.hf_export import (
    DEFAULT_MAX_SHARD_SIZE,
    PretrainedWriter,
    TensorSpec,
    parse_dtype,
    parse_max_shard_size,
    plan_shards,
)
from flatshard.checkpoint.storage import Remote, locate_checked

__all__ = ["PretrainedExport", "export_pretrained"]


@dataclass(frozen=True)
class PretrainedExport:
    """What :func:`export_pretrained` wrote.

    Attributes:
        path: the directory (the URL for a URL).
        files: the weight files, in order (the index, when there is one, is ``model.safetensors.index.json``).
        tensors: how many tensors they store.
        nbytes: the tensors' bytes.
        aliases: ``{tied name: stored name}`` of the names stored once (``from_pretrained`` ties them again).
        notes: what was left out or taken from elsewhere, one sentence each.
    """

    path: Path | str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    aliases: dict[str, str]
    notes: tuple[str, ...]


def export_pretrained(
    src: str | os.PathLike[str] | Remote,
    out_dir: str | os.PathLike[str] | Remote,
    *,
    prefix: str = "",
    ema: bool | str = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    progress: bool = False,
) -> PretrainedExport:
    """Write the model weights of a checkpoint to ``out_dir`` in Hugging Face's layout: ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``.

    Runs on one process, with no process group. Files already in ``out_dir`` (config, tokenizer, README) are kept;
    the weight files of an earlier export are replaced, and ``out_dir`` changes only once every file is written.

    Args:
        src: a sharded checkpoint directory or a full checkpoint file, a local path or an fsspec URL.
        out_dir: the directory, a local path or an fsspec URL.
        prefix: keep only the state-dict names that start with it, with it removed (default ``""``: all).
            ``"model."`` gives the weights of a LightningModule's ``self.model``.
        ema: ``True`` exports the EMA weights of the checkpoint's ``ShardedEMA`` callback state; a string names the
            callback state key when there are several (default ``False``).
        max_shard_size: the size limit per file: bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` (default ``"5GB"``).
        dtype: cast floating-point tensors to this dtype (``"bfloat16"``, ``torch.float16``; default: their own).
        progress: show a progress bar on stderr for exports of at least 256 MiB (default ``False``).

    Returns:
        A :class:`PretrainedExport`: the directory, the files, the tensors and bytes written, tied names, notes.
    """
    limit = parse_max_shard_size(max_shard_size)
    cast = parse_dtype(dtype)
    target = locate_checked(out_dir)  # an unreachable destination fails before anything is read
    state, entries, aliases = open_entries(src, prefix, ema, "export_pretrained")
    if aliases:
        state.notes.append(
            f"{len(aliases)} tied names stored once under the first name (from_pretrained ties the others "
            f"again): {', '.join(f'{a} -> {s}' for a, s in list(aliases.items())[:5])}"
            + (f" and {len(aliases) - 5} more" if len(aliases) > 5 else "")
        )
    specs = [
        TensorSpec(
            e.name, cast if cast is not None and e.dtype.is_floating_point else e.dtype, tuple(e.shape)
        )
        for e in entries
    ]
    plan = plan_shards(specs, limit)
    label = os.path.basename(str(out_dir).rstrip("/")) + "/"
    with Progress(plan.total_size, progress and plan.total_size >= PROGRESS_MIN_BYTES, label) as bar:
        with PretrainedWriter(target, plan, progress=bar.update) as writer:
            for entry, tensor in read_tensors(entries, state.reader):
                if tensor.dtype != entry.dtype or tensor.shape != entry.shape:  # a damaged directory
                    raise CheckpointError(
                        f"{state.path}: {entry.name!r} was read as {tensor.dtype} {tuple(tensor.shape)}, expected "
                        f"{entry.dtype} {tuple(entry.shape)}. HINT: use an earlier checkpoint."
                    )
                writer.write(
                    entry.name, tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
                )
                if state.pages is not None:  # the pages just read from a mapped file go back
                    state.pages.release(tensor)
            path = writer.finish()
    return PretrainedExport(
        path, tuple(f.name for f in plan.files), len(specs), plan.total_size, aliases, tuple(state.notes)
    )
