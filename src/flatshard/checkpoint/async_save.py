"""Asynchronous sharded saves: stage a copy in CPU memory, write it in the background while training goes on.

[Note: asynchronous sharded saves]
A sharded save (see [Note: sharded checkpoint layout]) has three parts: planning (DCP's save plans go to rank 0
and back: collectives), writing (each rank writes its own data file: no communication), and finishing (rank 0
writes ``.metadata`` into the hidden directory and renames it into place once every rank has written).
:meth:`AsyncSaver.save` does on the calling (training) thread everything that needs a collective or the live
state: it waits for the previous save, copies this rank's entries (model pieces, optimizer state pieces and, on
rank 0, ``extra``) into fresh CPU memory, so training may change the live tensors as soon as it returns,
prepares the hidden directory and exchanges the plans. A thread of its own then writes the data file and, on
rank 0, finishes.

The background thread never runs a collective: collectives from two threads of one process would interleave
with training's on the same process group. So the ranks tell rank 0 that they are done through the shared
directory they all write into (a local sharded save already needs one, since rank 0 renames what every rank
wrote): each writes a marker file ``.flatshard-done-<rank>`` holding its write results (or
``.flatshard-error-<rank>`` with its error), and rank 0's thread waits for them, writes ``.metadata``, removes
the markers and renames the directory. Nothing changes for atomicity: the checkpoint appears only complete, and
a process killed at any point leaves the previous checkpoint of that name as it was (the next save removes the
hidden directory it left).

This is flatshard's own thread rather than DCP's ``async_save``: that one runs DCP's whole ``save``, plans and
final gather included, in its background thread, so its collectives need a process group of their own, and
its staging knows nothing of flatshard's piece entries; the local rename after every rank has finished would
still need a collective at the end.

At a URL (see [Note: checkpoint storage]) the same steps run without a directory to rename: every rank's thread
writes its data object under a name unique to the save, the other ranks' markers are objects named after the
save (``.flatshard-done-<rank>-<save id>``) that rank 0 polls, and rank 0 writes ``meta.pt`` and ``.metadata``
last, then deletes the markers and earlier saves' data objects. Until ``.metadata`` lands the previous
checkpoint of that name is the one a load reads; a process killed mid-save leaves only unreferenced objects,
which the next save of that name deletes.

The next save, a load and the end of training wait for the write in flight; so does the removal of the
checkpoint being written (removing another one is safe meanwhile: a save touches only its own name and hidden
siblings). A failed write is raised by the next of those calls, naming the path and the rank; where every rank
calls (a save, a load) every rank raises.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from flatshard.checkpoint.dcp_layout import Names
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.remote_dcp import RemoteWriter, remove_stale_objects
from flatshard.checkpoint.sharded import (
    EXTRA_KEY,
    SavePlanner,
    flatten_checkpoint,
    prepare_temporary,
    replace_directory,
    write_lightning_meta,
)
from flatshard.checkpoint.storage import Location, Remote, locate, locate_checked, storage_error
from flatshard.checkpoint.validate import agree_on_error
from flatshard.engine import ParamShard, global_rank

__all__ = ["PEER_TIMEOUT_S", "AsyncSaver", "stage_entries"]

PEER_TIMEOUT_S = 1800.0  # how long rank 0's writer thread waits for the other ranks' data files
_POLL_S, _REMOTE_POLL_S = 0.02, 0.5  # how often rank 0 looks for the other ranks' markers
_DONE, _ERROR = ".flatshard-done-", ".flatshard-error-"

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- staging
def stage_entries(entries: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of DCP entries in CPU memory that shares nothing with the live state (see [Note: asynchronous
    sharded saves]): pieces and tensors copied into fresh, compact CPU tensors (pinned from CUDA), objects
    through a ``torch.save`` round trip (which also raises here, not in the background, for one that cannot be
    saved)."""
    staged: dict[str, Any] = {}
    copied_from_cuda = False
    for fqn, value in entries.items():
        if isinstance(value, ParamShard):
            copied_from_cuda |= value.local.is_cuda
            staged[fqn] = ParamShard(_copy_tensor(value.local), value.offset, value.shape)
        elif isinstance(value, torch.Tensor):
            copied_from_cuda |= value.is_cuda
            staged[fqn] = _copy_tensor(value)
        else:
            buf = io.BytesIO()
            torch.save(value, buf)
            buf.seek(0)
            staged[fqn] = torch.load(buf, map_location="cpu", weights_only=False)
    if copied_from_cuda:
        torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
    return staged


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach(), non_blocking=t.is_cuda)


# ---------------------------------------------------------------------------------------------- one save
class _Markers:
    """Where the other ranks tell rank 0 they have written (see [Note: asynchronous sharded saves]): files in the
    hidden directory every rank writes into, or objects under the checkpoint's URL named after the save."""

    def __init__(self, where: Path | Remote, save_id: str = "") -> None:
        self.where = where
        self.suffix = f"-{save_id}" if save_id else ""
        self.poll_s = _REMOTE_POLL_S if isinstance(where, Remote) else _POLL_S

    def name(self, kind: str, rank: int) -> str:
        return f"{kind}{rank}{self.suffix}"

    def write(self, kind: str, rank: int, payload: bytes) -> None:
        name = self.name(kind, rank)
        if isinstance(self.where, Remote):
            self.where.fs.pipe_file(self.where.child(name).path, payload)  # one request: whole or absent
        else:
            partial = self.where / f"{name}.partial"
            partial.write_bytes(payload)
            os.replace(partial, self.where / name)

    def read(self, kind: str, rank: int) -> bytes | None:
        name = self.name(kind, rank)
        try:
            if isinstance(self.where, Remote):
                return bytes(self.where.fs.cat_file(self.where.child(name).path))
            return (self.where / name).read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, kind: str, rank: int) -> None:
        name = self.name(kind, rank)
        try:
            if isinstance(self.where, Remote):
                self.where.fs.rm_file(self.where.child(name).path)
            else:
                (self.where / name).unlink()
        except FileNotFoundError:
            pass


@dataclass(eq=False)
class _Job:
    """One save in flight: what its thread needs, and what it left."""

    target: Location
    tmp: Path | None  # the hidden directory of a local save
    markers: _Markers
    rank: int
    world: int
    writer: dcp.FileSystemWriter
    planner: SavePlanner
    plan: SavePlan
    metadata: Metadata | None  # rank 0 only
    peer_timeout_s: float
    thread: threading.Thread | None = None
    error: BaseException | None = field(default=None)
    abandoned: threading.Event = field(default_factory=threading.Event)  # the run failed: stop waiting


def _plan(
    entries: dict[str, Any], paths: dict[str, tuple[str | int, ...]], writer: dcp.FileSystemWriter
) -> tuple[SavePlanner, SavePlan, Any]:
    """DCP's planning step (collective when a process group exists), as ``dcp.save`` runs it."""
    distributed = dist.is_available() and dist.is_initialized()
    dist_wrapper = _DistWrapper(None, distributed, 0)
    planner = SavePlanner(entries, paths)
    metadata: list[Metadata] = []

    def local_step() -> SavePlan:
        planner.set_up_planner(entries, writer.storage_meta(), dist_wrapper.is_coordinator)
        writer.set_up_storage_writer(
            dist_wrapper.is_coordinator, rank=dist_wrapper.rank, use_collectives=True
        )
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: list[SavePlan]) -> list[SavePlan]:
        plans, global_metadata = planner.create_global_plan(plans)
        metadata.append(global_metadata)
        return writer.prepare_global_plan(plans)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        if distributed:
            plan = dist_wrapper.reduce_scatter("plan", local_step, global_step)
        else:
            plan = global_step([local_step()])[0]
    return planner, plan, metadata[0] if metadata else None


def _run(job: _Job) -> None:
    """The background thread: this rank's data file, then (rank 0) the metadata and the rename."""
    try:
        final = job.planner.finish_plan(job.plan)
        future = job.writer.write_data(final, job.planner)
        future.wait()
        results: list[WriteResult] = future.value()
        if job.rank != 0:
            job.markers.write(_DONE, job.rank, pickle.dumps(results))
            return
        all_results = [results, *_peer_results(job)]
        assert job.metadata is not None
        if job.tmp is not None:
            write_lightning_meta(job.planner.entry(EXTRA_KEY), job.tmp)
        job.writer.finish(job.metadata, all_results)  # at a URL: meta.pt, then .metadata
        for rank in range(1, job.world):
            job.markers.remove(_DONE, rank)
        if isinstance(job.target, Remote):
            assert isinstance(job.writer, RemoteWriter)
            remove_stale_objects(job.target, keep=set(job.writer.written))
        else:
            assert job.tmp is not None
            replace_directory(job.tmp, job.target)
    except BaseException as err:  # DCP's error is a BaseException; kept for the next wait
        job.error = err
        if job.rank != 0:
            try:
                job.markers.write(_ERROR, job.rank, f"{type(err).__name__}: {err}".encode())
            except Exception:
                pass  # rank 0 reports the timeout; this rank reports its own error


def _peer_results(job: _Job) -> list[list[WriteResult]]:
    """Rank 0: the other ranks' write results, read from their markers as they appear."""
    results: dict[int, list[WriteResult]] = {}
    deadline = time.monotonic() + job.peer_timeout_s
    while len(results) < job.world - 1:
        if job.abandoned.is_set():
            raise CheckpointError(
                "abandoned: the run failed before every rank finished writing its data file; the previous "
                "checkpoint at this path is unchanged"
            )
        for rank in range(1, job.world):
            if rank in results:
                continue
            error = job.markers.read(_ERROR, rank)
            if error is not None:
                raise CheckpointError(f"rank {rank} could not write its data file ({error.decode()})")
            done = job.markers.read(_DONE, rank)
            if done is not None:
                results[rank] = pickle.loads(done)
        if len(results) < job.world - 1:
            if time.monotonic() > deadline:
                missing = [r for r in range(1, job.world) if r not in results]
                raise CheckpointError(
                    f"ranks {missing} did not finish writing their data files within {job.peer_timeout_s:.0f} s "
                    f"(no {job.markers.name(_DONE, missing[0])} marker in {job.markers.where}; every rank must "
                    "see the same storage)"
                )
            time.sleep(job.markers.poll_s)
    return [results[r] for r in range(1, job.world)]


def _agreed_save_id() -> str:
    """Rank 0's new save id, on every rank (collective when a process group exists)."""
    ids = [uuid.uuid4().hex[:12]]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


# ---------------------------------------------------------------------------------------------- the saver
class AsyncSaver:
    """Sharded saves written in the background, one at a time (see [Note: asynchronous sharded saves]).

    Args:
        peer_timeout_s: how long rank 0's writer thread waits for the other ranks' data files. Default: 1800.
    """

    def __init__(self, peer_timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.peer_timeout_s = peer_timeout_s
        self._job: _Job | None = None

    @property
    def in_flight(self) -> Location | None:
        """The path of the save being written (or written and not yet waited for), if any."""
        return None if self._job is None else self._job.target

    @property
    def writing(self) -> bool:
        """Whether the background thread is still writing (the save is in flight and not finished)."""
        job = self._job
        return job is not None and job.thread is not None and job.thread.is_alive()

    def save(
        self, checkpoint: Mapping[str, Any], path: str | os.PathLike[str] | Remote, names: Names | None = None
    ) -> Path | str:
        """Stage ``checkpoint`` (holding sharded state) and start writing it to the directory ``path`` (a local
        path or a URL); every rank calls. Waits for the previous save first and raises its error on every rank.
        ``names``: see :func:`~flatshard.checkpoint.sharded.flatten_checkpoint`. Returns the path (the URL for a
        URL)."""
        self.wait(collective=True)
        target = locate_checked(path)  # a URL's storage answers on every rank before anything is staged
        flat = flatten_checkpoint(checkpoint, names)
        rank = global_rank()
        staged = stage_entries(flat.entries)
        paths = flat.paths
        extra = staged.get(EXTRA_KEY) if flat.extra is not None else None  # the staged copy: training goes on
        del flat
        tmp: Path | None = None
        if isinstance(target, Remote):
            save_id = _agreed_save_id()  # names the data objects and the markers alike on every rank
            writer: dcp.FileSystemWriter = RemoteWriter(target, save_id, extra)
            markers = _Markers(target, save_id)
            label = target.url.rstrip("/").rsplit("/", 1)[-1]
        else:
            tmp = prepare_temporary(target)
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
            markers = _Markers(tmp)
            label = target.name
        try:
            planner, plan, metadata = _plan(staged, paths, writer)
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            if isinstance(target, Remote):
                raise storage_error(target, err, "plan the sharded checkpoint") from err
            raise
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        job = _Job(target, tmp, markers, rank, world, writer, planner, plan, metadata, self.peer_timeout_s)
        job.thread = threading.Thread(target=_run, args=(job,), name=f"flatshard-save-{label}")
        self._job = job
        job.thread.start()
        return target if isinstance(target, Path) else target.url

    def wait(self, *, collective: bool = False) -> None:
        """Wait for the save in flight; raise its error naming the path. ``collective``: every rank calls, and
        every rank raises if the save failed on any (otherwise only the ranks that saw it fail raise)."""
        job, self._job = self._job, None
        if job is None:
            return
        assert job.thread is not None
        job.thread.join()
        error = None if job.error is None else _failed(job)
        if collective:
            agree_on_error(error, f"The asynchronous save of {job.target}")
        elif error is not None:
            raise error

    def abandon(self, timeout_s: float = 10.0) -> None:
        """The run failed: stop waiting for peers that may never finish, give the writer ``timeout_s`` to
        return, and forget the save (its hidden directory is never renamed into place, so a previous checkpoint
        at that path stays intact). Never raises; nothing collective."""
        job, self._job = self._job, None
        if job is None or job.thread is None:
            return
        job.abandoned.set()
        job.thread.join(timeout=timeout_s)

    def wait_for(self, path: str | os.PathLike[str]) -> None:
        """Wait (on this rank) if the save in flight writes ``path``; before removing it, for instance."""
        job = self._job
        if job is not None and _same_location(locate(path), job.target):
            self.wait()


def _same_location(a: Location, b: Location) -> bool:
    if isinstance(a, Remote) or isinstance(b, Remote):
        return isinstance(a, Remote) and isinstance(b, Remote) and a.url.rstrip("/") == b.url.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def _failed(job: _Job) -> CheckpointError:
    err = job.error
    assert err is not None
    failure = CheckpointError(
        f"The asynchronous save of {job.target} failed on rank {job.rank} ({type(err).__name__}: {err}). That "
        "checkpoint was not written; a previous checkpoint at that path is unchanged. HINT: fix the cause (disk "
        "space, permissions, a directory every rank sees) and save again; the training state is unaffected."
    )
    failure.__cause__ = err
    return failure
