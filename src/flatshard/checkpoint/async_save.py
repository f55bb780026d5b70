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
with training's on the same process group. So the ranks' threads tell each other how the write went through
the c10d store of the default process group (see [Note: save outcomes through the store]), never through the
storage being written (a full disk could not take a rank's error report): each thread counts itself in once its
data file is written, handing rank 0 its write results; rank 0's thread waits for every rank, writes
``.metadata``, renames the directory, and counts itself in at "committed", which the other ranks' threads wait
for. A rank that fails posts its error, and a rank whose process exited, or went silent, is posted as gone by
the rank watching it; every waiting thread then stops within seconds, rank 0 removes the hidden directory (each
rank its own data file) and every rank's save ends with the same error. Nothing changes for atomicity: the
checkpoint appears only complete, and a process killed at any point leaves the previous checkpoint of that name
as it was (the next save in that folder removes the hidden directory it left, see [Note: stale temporaries]).

This is flatshard's own thread rather than DCP's ``async_save``: that one runs DCP's whole ``save``, plans and
final gather included, in its background thread, so its collectives need a process group of their own, and
its staging knows nothing of flatshard's piece entries; the local rename after every rank has finished would
still need a collective at the end.

At a URL (see [Note: checkpoint storage]) the same steps run without a directory to rename: every rank's thread
writes its data object under a name unique to the save, and rank 0 writes ``meta.pt`` and ``.metadata`` last,
then deletes earlier saves' data objects. Until ``.metadata`` lands the previous checkpoint of that name is the
one a load reads; a failed save's data objects are deleted, and a process killed mid-save leaves only
unreferenced objects, which the next save of that name deletes.

The next save, a load and the end of training wait for the write in flight; so does the removal of the
checkpoint being written (removing another one is safe meanwhile: a save touches only its own name and hidden
siblings). A failed write is raised by the next of those calls on every rank, naming the path, the failing
rank and the cause. When the run fails meanwhile, the save is abandoned: its threads stop waiting and the hidden
directory is removed.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
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

from flatshard.checkpoint import temporaries
from flatshard.checkpoint.dcp_layout import Names
from flatshard.checkpoint.directory import EXTRA_KEY, SavePlanner, flatten_checkpoint
from flatshard.checkpoint.remote_dcp import RemoteWriter, remove_stale_objects
from flatshard.checkpoint.save_round import SaveRound
from flatshard.checkpoint.storage import Location, Remote, locate, locate_checked
from flatshard.checkpoint.write_sharded import (
    local_writer,
    prepare_remote,
    prepare_temporary,
    replace_directory,
    write_lightning_meta,
)
from flatshard.engine import ParamShard, global_rank

__all__ = ["PEER_TIMEOUT_S", "AsyncSaver", "stage_entries"]

PEER_TIMEOUT_S = 1800.0  # how long rank 0's writer thread waits for live ranks still writing their data files

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
            staged[fqn] = value.with_local(_copy_tensor(value.local))
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
@dataclass(eq=False)
class _Job:
    """One save in flight: what its thread needs, and what it left."""

    target: Location
    tmp: Path | None  # the hidden directory of a local save
    round: SaveRound
    writer: dcp.FileSystemWriter
    planner: SavePlanner
    plan: SavePlan
    metadata: Metadata | None  # rank 0 only
    peer_timeout_s: float
    thread: threading.Thread | None = None
    error: BaseException | None = field(default=None)
    abandoned: threading.Event = field(default_factory=threading.Event)  # the run failed: stop waiting
    commit: threading.Lock = field(default_factory=threading.Lock)  # the rename, or the abandonment


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
    """The background thread: this rank's data file; on rank 0 then the metadata and the rename, once every rank
    has written (see [Note: asynchronous sharded saves]). Ends with the save's outcome on every rank."""
    round_ = job.round
    try:
        final = job.planner.finish_plan(job.plan)
        future = job.writer.write_data(final, job.planner)
        future.wait()
        results: list[WriteResult] = future.value()
        round_.arrive("written", pickle.dumps(results))
        if round_.rank == 0:
            round_.wait("written", job.abandoned, job.peer_timeout_s)
            _finish(job, [pickle.loads(p) for p in round_.payloads("written")])
        round_.agree("committed", job.abandoned)
    except BaseException as err:  # DCP's error is a BaseException; kept for the next wait
        with job.commit:
            job.error = round_.fail(err)
            job.error.__cause__ = err
    finally:
        round_.close()


def _finish(job: _Job, results: list[list[WriteResult]]) -> None:
    """Rank 0: the metadata, then the rename (or at a URL, earlier saves' objects go)."""
    assert job.metadata is not None
    if job.tmp is not None:
        write_lightning_meta(job.planner.entry(EXTRA_KEY), job.tmp)
    with job.commit:  # an abandoned save is never renamed into place
        if job.abandoned.is_set():
            raise RuntimeError("the run failed, so the save was abandoned")
        job.writer.finish(job.metadata, results)  # at a URL: meta.pt, then .metadata
        if isinstance(job.target, Remote):
            job.round.committed()
            assert isinstance(job.writer, RemoteWriter)
            remove_stale_objects(job.target, keep=set(job.writer.written))
        else:
            assert job.tmp is not None
            replace_directory(job.tmp, job.target)
            job.round.committed()


# ---------------------------------------------------------------------------------------------- the saver
class AsyncSaver:
    """Sharded saves written in the background, one at a time (see [Note: asynchronous sharded saves]).

    Args:
        peer_timeout_s: how long rank 0's writer thread waits for ranks that are alive but still writing their
            data files (a rank that failed or died is reported within seconds). Default: 1800.
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
        ``names``: see :func:`~flatshard.checkpoint.directory.flatten_checkpoint`. Returns the path (the URL for a
        URL)."""
        self.wait(collective=True)
        target = locate_checked(path)  # a URL's storage answers on every rank before anything is staged
        round_ = SaveRound("The asynchronous save", target)
        try:
            job = self._prepare(round_, target, checkpoint, names)
        except BaseException as err:
            round_.abort(err)
        label = target.url.rsplit("/", 1)[-1] if isinstance(target, Remote) else target.name
        job.thread = threading.Thread(target=_run, args=(job,), name=f"flatshard-save-{label}")
        self._job = job
        job.thread.start()
        return target if isinstance(target, Path) else target.url

    def _prepare(
        self, round_: SaveRound, target: Location, checkpoint: Mapping[str, Any], names: Names | None
    ) -> _Job:
        """On the calling thread: the staged copy, the hidden directory and DCP's plans (collectives)."""
        flat = flatten_checkpoint(checkpoint, names)
        staged = stage_entries(flat.entries)
        extra = staged.get(EXTRA_KEY) if flat.extra is not None else None  # the staged copy: training goes on
        tmp: Path | None = None
        if isinstance(target, Remote):
            writer: dcp.FileSystemWriter = RemoteWriter(target, round_.id, extra)
            prepare_remote(target, round_)
        else:
            tmp = prepare_temporary(target, round_)
            writer = local_writer(tmp)
        round_.agree("staged")  # before DCP's collectives: a rank that failed does not enter them
        planner, plan, metadata = _plan(staged, flat.paths, writer)
        return _Job(target, tmp, round_, writer, planner, plan, metadata, self.peer_timeout_s)

    def wait(self, *, collective: bool = False) -> None:
        """Wait for the save in flight; raise its error naming the path, the failing rank and the cause. Every
        rank's thread ends knowing how the save went on every rank, so every rank that waits raises (``collective``
        is kept for callers that say every rank calls)."""
        job, self._job = self._job, None
        if job is None:
            return
        assert job.thread is not None
        job.thread.join()
        if job.error is not None:
            raise job.error

    def abandon(self, timeout_s: float = 10.0) -> None:
        """The run failed: stop waiting for peers that may never finish, give the writer ``timeout_s`` to
        return, and forget the save. Its hidden directory is never renamed into place, so a previous checkpoint
        at that path stays intact, and it is removed (by rank 0's thread, or here if that thread is stuck
        writing). Never raises; nothing collective."""
        job, self._job = self._job, None
        if job is None or job.thread is None:
            return
        job.abandoned.set()
        job.thread.join(timeout=timeout_s)
        if job.thread.is_alive() and job.tmp is not None and global_rank() == 0:
            if job.commit.acquire(timeout=timeout_s):  # not while it renames; it never renames after this
                try:
                    temporaries.remove(job.tmp)
                finally:
                    job.commit.release()

    def wait_for(self, path: str | os.PathLike[str]) -> None:
        """Wait (on this rank) if the save in flight writes ``path``; before removing it, for instance."""
        job = self._job
        if job is not None and _same_location(locate(path), job.target):
            self.wait()


def _same_location(a: Location, b: Location) -> bool:
    if isinstance(a, Remote) or isinstance(b, Remote):
        return isinstance(a, Remote) and isinstance(b, Remote) and a.url.rstrip("/") == b.url.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)
