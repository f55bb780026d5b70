"""Writing sharded checkpoints: every rank its pieces into a hidden directory renamed into place, or at a URL
data objects under the save's id with the metadata last (see [Note: sharded checkpoint layout]).

Every step that may fail on one rank is followed by an agreement through the store, so a failure anywhere stops
every rank within seconds and removes what the save wrote (see [Note: save outcomes through the store]).

[Note: dtypes of a sharded checkpoint]
DCP writes each tensor with ``torch.save`` but plans it through its own code, which takes the bits dtypes apart
(their element size) and writes quantized tensors it cannot read back. Before anything is written, every tensor
the save holds is checked: its dtype must come back bit for bit from a probe (a small tensor of that dtype saved
and loaded by DCP in this process, once per dtype), and the entries of ``meta.pt`` must pass the ``torch.save``
probe of [Note: every dtype torch.save writes]. Otherwise the save fails on every rank, naming the entry, its
dtype and a hint (a full checkpoint keeps every dtype ``torch.save`` stores).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import tempfile
import warnings
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from flatshard.checkpoint import temporaries
from flatshard.checkpoint.dcp_layout import LIGHTNING_META, Names
from flatshard.checkpoint.directory import Flattened, SavePlanner, flatten_checkpoint
from flatshard.checkpoint.files import fsync_dir, recording
from flatshard.checkpoint.remote_dcp import RemoteWriter, remove_save_objects, remove_stale_objects
from flatshard.checkpoint.save_round import SaveRound
from flatshard.checkpoint.storage import Remote, locate_checked
from flatshard.checkpoint.stream_file import (
    dtype_sample,
    refuse,
    tensor_bits,
    unreadable_dtype,
    unreadable_tensors,
)
from flatshard.engine import ParamShard, global_rank

__all__ = [
    "dcp_unreadable_dtype",
    "discard_on_failure",
    "local_writer",
    "prepare_remote",
    "prepare_temporary",
    "refuse_unstorable",
    "replace_directory",
    "write_lightning_meta",
    "write_sharded_checkpoint",
]


def write_sharded_checkpoint(
    checkpoint: Mapping[str, Any], path: str | os.PathLike[str] | Remote, names: Names | None = None
) -> Path | str:
    """Write a checkpoint dict whose ``state_dict`` / ``optimizer_states`` hold sharded state; all ranks call.

    See [Note: sharded checkpoint layout]. ``path`` is a local directory or a URL; an existing checkpoint there
    (file or directory) is replaced only once the new one is complete. If the save fails on any rank, every
    rank raises within seconds and what it wrote is removed. ``names``: see
    :func:`~flatshard.checkpoint.directory.flatten_checkpoint`. Returns the path (the URL for a URL).
    """
    location = locate_checked(path)  # a URL's storage answers on every rank before anything is written
    with SaveRound("The sharded save", location) as round_:
        flat = flatten_checkpoint(checkpoint, names)
        refuse_unstorable(flat)  # before anything is written: see [Note: dtypes of a sharded checkpoint]
        if isinstance(location, Remote):
            writer = RemoteWriter(location, round_.id, flat.extra)
            prepare_remote(location, round_)
            _dcp_save(flat, writer)  # DCP's collectives carry a rank's error to every rank
            if global_rank() == 0:
                round_.committed()  # the metadata is in place
                remove_stale_objects(location, keep=set(writer.written))
            round_.agree("committed")
            return location.url
        tmp = prepare_temporary(location, round_)
        if flat.extra is not None:
            write_lightning_meta(flat.extra, tmp)
        round_.agree("meta written")  # before DCP's collectives: a rank that failed does not enter them
        _dcp_save(flat, local_writer(tmp))
        if global_rank() == 0:
            replace_directory(tmp, location)
            round_.committed()
        round_.agree("committed")
    return location


def refuse_unstorable(flat: Flattened) -> None:
    """Raise a ``CheckpointError`` naming the entries of ``flat`` that would not read back (see [Note: dtypes of
    a sharded checkpoint])."""
    tensors = {
        fqn: value.local if isinstance(value, ParamShard) else value
        for fqn, value in flat.entries.items()
        if isinstance(value, (ParamShard, torch.Tensor))
    }
    refuse(unreadable_tensors(tensors, dcp_unreadable_dtype), "a sharded checkpoint")
    if flat.extra is not None:
        refuse(unreadable_tensors(flat.extra), f"a sharded checkpoint's {LIGHTNING_META}")


class _ProbeWriter(dcp.FileSystemWriter):
    """DCP's local writer for the probe, its ``write_data`` as torch defines it: code that wraps
    ``FileSystemWriter.write_data`` later (to slow or fail a save) wraps the save, not the probe."""

    write_data = dcp.FileSystemWriter.write_data


@functools.cache
def dcp_unreadable_dtype(dtype: torch.dtype) -> str | None:
    """Why DCP would not give back a tensor of ``dtype`` bit for bit (ending in a hint), ``None`` where it does:
    a sample saved and loaded in this process (no collective), once per dtype."""
    problem = unreadable_dtype(dtype)
    if problem is not None:  # torch.save itself cannot: the hint for that
        return problem
    sample = dtype_sample(dtype)
    try:
        with tempfile.TemporaryDirectory(prefix="flatshard-probe-") as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group is the intent; quantized dtypes are deprecated
            dcp.save({"x": sample}, storage_writer=_ProbeWriter(folder), no_dist=True)
            back = {"x": torch.empty(sample.shape, dtype=dtype)}
            dcp.load(back, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
        if tensor_bits(back["x"]) != tensor_bits(sample):
            raise ValueError("it reads back with other bits")
    except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
        return (
            f"torch.distributed.checkpoint cannot store it ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1][:200]}). HINT: save a full checkpoint (state_dict_type='full'), "
            "which keeps every dtype torch.save stores, or hold the values in a dtype DCP stores."
        )
    return None


def write_lightning_meta(extra: Mapping[str, Any], directory: Path) -> None:
    """Rank 0: the checkpoint's other entries as ``meta.pt``, where Lightning's own strategies read them."""
    with open(directory / LIGHTNING_META, "wb") as f:
        torch.save(dict(extra), f)
        f.flush()
        os.fsync(f.fileno())


def prepare_temporary(target: Path, round_: SaveRound) -> Path:
    """The empty hidden sibling a local save of ``target`` writes into, created by rank 0 after it swept the
    folder (see [Note: stale temporaries]); all ranks call. Registers its removal should the save fail."""
    tmp = temporaries.hidden_directory(target)
    if global_rank() == 0:
        tmp = temporaries.create_hidden_directory(target)
        discard_on_failure(round_, target)
    round_.agree("hidden directory")
    if global_rank() != 0:  # only now is it this save's: a refusal must remove nothing of a live owner's
        discard_on_failure(round_, target)
    return tmp


def prepare_remote(target: Remote, round_: SaveRound) -> None:
    """A sharded save to a URL: rank 0 removes what dead saves left beside ``target`` and writes this save's
    owner object (see [Note: stale temporaries]); all ranks call. Registers the removal of the save's objects
    should it fail."""
    discard_on_failure(round_, target)
    if global_rank() == 0:
        temporaries.claim_remote(target, round_.id)
    round_.agree("owner written")  # before any data object: a rank that failed does not enter DCP


def discard_on_failure(round_: SaveRound, target: Path | Remote) -> None:
    """Should the save fail before it is committed: rank 0 removes the hidden directory (at a URL, the save's
    objects), every other rank its own data file (which, in a folder every rank sees, is gone already)."""
    rank = global_rank()
    if isinstance(target, Remote):
        if rank == 0:
            round_.on_failure(lambda: remove_save_objects(target, round_.id))
        return
    tmp = temporaries.hidden_directory(target)
    if rank == 0:
        round_.on_failure(lambda: temporaries.remove(tmp))
        return

    def remove_own() -> None:
        for data in tmp.glob(f"__{rank}_*"):
            temporaries.remove(data)
        if tmp.is_dir() and not any(tmp.iterdir()):
            tmp.rmdir()  # a folder only this rank sees, emptied

    round_.on_failure(remove_own)


def replace_directory(tmp: Path, target: Path) -> None:
    """Rank 0, once every rank's data and the metadata are in ``tmp``: rename it into place, the old one aside
    first and deleted after (see [Note: sharded checkpoint layout])."""
    old = target.parent / f".{target.name}.flatshard-old"
    (tmp / temporaries.OWNER).unlink(missing_ok=True)
    fsync_dir(tmp)
    if target.exists() or target.is_symlink():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old.exists() and not target.exists():
            os.replace(old, target)  # the previous checkpoint back in place; the failed save removes tmp
        raise
    fsync_dir(target.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()


class _RecordingFiles(dcp_filesystem.FileSystem):
    """DCP's local file operations, with a write's ``OSError`` (a full disk) raised as itself rather than as
    ``torch.save``'s "unexpected pos"."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream, recording(stream) as recorded:
            yield recorded


def local_writer(directory: Path) -> dcp.FileSystemWriter:
    """DCP's writer of a local sharded save into ``directory``: one fsynced file per rank."""
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True)
    writer.fs = _RecordingFiles()
    return writer


def _dcp_save(flat: Flattened, writer: dcp.FileSystemWriter) -> None:
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(flat.entries, storage_writer=writer, planner=SavePlanner(flat.entries, flat.paths))
