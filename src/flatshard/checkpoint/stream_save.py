"""A full checkpoint written unit by unit as it is gathered: rank 0 never holds the whole consolidated state.

[Note: streamed full saves]
``get_state_dict(full=True)`` returns the whole consolidated state in memory, so saving it that way peaks at
the training state plus the whole model and optimizer state on rank 0. :func:`save_full_streamed` gathers the
same items (see [Note: streamed full-state gathers]) one unit at a time, the unit's parameters and its
optimizer states together, and rank 0 writes each gathered tensor into the file at once (see [Note: a
torch.save file written as it streams]) and drops it; the dict is then assembled from the records' stand-ins
and pickled last. Rank 0's peak is its training state plus one unit's gathered tensors (parameters and, with
AdamW, two states) and the small tensors kept whole (buffers, step counters). The file is the one
``torch.save`` writes for the same dict, written as :func:`~flatshard.checkpoint.files.atomic_write` writes any
full checkpoint (a temporary, fsync, rename; at a URL one committed upload). A write that fails on rank 0
leaves the file unfinished; rank 0 keeps taking part in the remaining gathers (its peers are in them) without
writing, then the save fails on every rank through the save round, and the temporary is removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn as nn

from flatshard.checkpoint.files import atomic_write, refuse_directory, refuse_pieces
from flatshard.checkpoint.save_round import SaveRound, gather_for_save
from flatshard.checkpoint.storage import Remote, locate_checked
from flatshard.checkpoint.stream_file import StreamedTorchFile, TensorRecord
from flatshard.engine import FullStates, global_rank

__all__ = ["ModelState", "OptimizerState", "save_full_streamed"]


@dataclass(frozen=True)
class ModelState:
    """In a checkpoint given to :func:`save_full_streamed`: ``module``'s full state dict, written as it streams.

    ``keep(key, value)``, if given, selects the entries written (Fabric's ``save(..., filter=...)``): called on the
    writing rank with each gathered tensor before it is written; a tensor no key of which is kept is not written.
    Where no entry is kept, the marker's key is left out of the checkpoint, as Fabric leaves it out.
    """

    module: nn.Module
    keep: Callable[[str, Any], bool] | None = None


@dataclass(frozen=True)
class OptimizerState:
    """In a checkpoint given to :func:`save_full_streamed`: ``optimizer``'s full state (in the plain format) over
    the sharded ``module``, written as it streams."""

    module: nn.Module
    optimizer: torch.optim.Optimizer


def save_full_streamed(path: str | os.PathLike[str] | Remote, checkpoint: Mapping[str, Any]) -> Path | str:
    """Every rank calls; rank 0 writes ``checkpoint`` to ``path`` as the units are gathered (see [Note: streamed
    full saves]): each :class:`ModelState` / :class:`OptimizerState` among its values (or in a list value)
    becomes that full state, the other values are written as they are. Returns the path (the URL for a URL)."""
    refuse_pieces({k: v for k, v in checkpoint.items() if not _streamed(v)})
    location = locate_checked(path)
    keep = global_rank() == 0
    markers = [m for v in checkpoint.values() for m in (v if isinstance(v, list) else [v]) if _streamed(m)]
    with gather_for_save(location):  # the ranks agree on metadata collectively; a peer that died is named
        states = FullStates([(m.module, getattr(m, "optimizer", None)) for m in markers], keep=keep)
    check = (lambda: refuse_directory(location)) if keep else None
    with SaveRound("The full save", location, check) as round_:
        if keep:
            atomic_write(location, lambda f: _stream(f, states, markers, checkpoint))
        else:
            _stream(None, states, markers, checkpoint)
        round_.agree("written")
    return location if isinstance(location, Path) else location.url


def _kept(
    state: dict[str, Any], keep: Callable[[str, Any], bool] | None, left_out: set[str]
) -> dict[str, Any] | None:
    """A marker's state as its filter selects it (entries not gathered, such as buffers, are asked here);
    ``None`` where it keeps nothing."""
    if keep is None:
        return state
    out = {
        k: v for k, v in state.items() if k not in left_out and (isinstance(v, TensorRecord) or keep(k, v))
    }
    return out or None


def _streamed(value: Any) -> bool:
    return isinstance(value, (ModelState, OptimizerState))


def _stream(
    f: IO[bytes] | None, states: FullStates, markers: list[Any], checkpoint: Mapping[str, Any]
) -> None:
    """Gather unit by unit on every rank; rank 0 (given ``f``) writes. A write that fails stops the writing, not
    the gathering: the peers are in those collectives, so rank 0 raises only once they are all done."""
    writer: StreamedTorchFile | None = None
    failure: list[BaseException] = []
    keeps = [getattr(m, "keep", None) for m in markers]
    dropped: list[set[str]] = [set() for _ in markers]  # per marker: keys its filter left out

    def consume(t: torch.Tensor, target: int, keys: tuple[str, ...]) -> Any:
        if writer is None or failure:
            return None
        try:
            keep = keeps[target]
            if keep is not None and keys:
                left_out = {k for k in keys if not keep(k, t)}
                dropped[target] |= left_out
                if len(left_out) == len(keys):
                    return None  # no key of it is kept: not written
            return writer.tensor(t)
        except Exception as err:
            failure.append(
                err
            )  # a filter that raises, or a failed write: the save fails once all gathers end
            return None

    try:
        if f is not None:
            try:
                writer = StreamedTorchFile(f)
            except Exception as err:
                failure.append(err)
        built = states.gather(consume)
        if failure:
            raise failure[0]
        if writer is None:
            return
        by_marker = {
            id(m): _kept(state, keep, left_out)
            for m, state, keep, left_out in zip(markers, built, keeps, dropped, strict=True)
        }

        def place(value: Any) -> Any:
            return by_marker[id(value)] if _streamed(value) else value

        writer.finish(
            {
                k: [place(x) for x in v] if isinstance(v, list) else place(v)
                for k, v in checkpoint.items()
                if not (_streamed(v) and by_marker[id(v)] is None)  # a filter kept nothing of it
            }
        )
    finally:
        if writer is not None:
            with contextlib.suppress(Exception):  # closed by finish(); after a failure, what it raised counts
                writer.close()
