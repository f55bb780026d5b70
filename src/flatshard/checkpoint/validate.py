"""Checks every loader runs before anything is applied, and their agreement across ranks.

[Note: chunk coverage]
A sharded directory's ``.metadata`` lists, for every tensor, the chunks (n-d boxes) its data files hold. A
reader asks DCP for the boxes it needs and DCP copies whatever stored chunks intersect them: where no chunk
lies, nothing is copied and the target keeps whatever memory it had; where two chunks overlap, the later one
wins; a chunk outside the shape is read or skipped depending on the request. So before anything is read,
:func:`check_chunks` requires every tensor's chunks to tile its shape exactly: each inside the shape, no two
sharing an element, and together as many elements as the shape has (which, given the first two, is a full
cover). Overlaps are found with a sweep along the dimension the chunks are cut most along, so the usual
layouts (row blocks, flatshard's boxes, column blocks) cost about ``n log n`` per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from flatshard.checkpoint.errors import CheckpointError

__all__ = [
    "agree_on_error",
    "check_chunks",
    "check_dtype_kinds",
    "check_optim_state_kinds",
    "check_optimizer_count",
    "check_required",
    "check_state_dict_kinds",
    "dtype_kind",
]

_Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

log = logging.getLogger(__name__)


def check_required(path: object, extra: Mapping[str, Any], required: Collection[str]) -> None:
    """Raise before anything is applied if the checkpoint lacks an entry the caller needs (every rank reads
    the same checkpoint, so every rank raises alike)."""
    missing = [k for k in required if k not in extra]
    if missing:
        raise KeyError(
            f"Checkpoint {path} has no entries {missing}; nothing was loaded. HINT: pass strict=False to skip "
            "them (with the Trainer: self.strict_loading = False in the LightningModule)."
        )


def agree_on_error(error: BaseException | None, what: str = "Loading") -> None:
    """Raise on every rank if a step (validation, a storage check, a write) failed on any, so no rank goes on
    alone; ``what`` names the step in the error the other ranks raise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise _said_once(error)
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise _said_once(error)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def _said_once(error: BaseException) -> BaseException:
    """The error without the chain of causes its message already quotes, so a failed load prints its message
    once per rank rather than once per cause; the cause's traceback goes to this module's debug log."""
    cause = error.__cause__
    if cause is not None and str(cause) and str(cause) in str(error):
        log.debug("the cause of %s", type(error).__name__, exc_info=cause)
        error.__cause__ = None
        error.__suppress_context__ = True
    return error


def check_optimizer_count(path: object, saved: int | None, optimizers: Sequence[Any]) -> None:
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


# ---------------------------------------------------------------------------------------------- chunks
def check_chunks(path: object, metadata: Metadata) -> None:
    """Raise unless every tensor's stored chunks tile its shape exactly (see [Note: chunk coverage])."""
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        try:
            shape = tuple(int(d) for d in md.size)
            chunks = [(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in md.chunks]
        except (AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"Sharded checkpoint {path}: its .metadata describes {fqn!r} in a form that cannot be read "
                f"({type(err).__name__}: {err}). HINT: the directory is damaged; use an earlier checkpoint."
            ) from err
        problem = _chunk_problem(shape, chunks)
        if problem is None:
            continue
        what, bad = problem
        named = [_describe(metadata, fqn, chunk) for chunk in bad]
        raise CheckpointError(
            f"Sharded checkpoint {path}: its .metadata stores {fqn!r} (shape {shape}, {_numel(shape)} elements) "
            f"as chunks that {what.format(*named)}. HINT: the directory is damaged, or its .metadata belongs to "
            "another save (a rank's data missing or doubled); use an earlier checkpoint, or save it again. "
            "Nothing was loaded."
        )


def _describe(metadata: Metadata, fqn: str, chunk: _Chunk) -> str:
    """A chunk, and the data file holding it if the metadata says."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    info = storage.get(MetadataIndex(fqn, torch.Size(chunk[0])))
    file = f" in {info.relative_path}" if info is not None else ""
    return f"the chunk at offsets {chunk[0]} of size {chunk[1]}{file}"


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _chunk_problem(shape: tuple[int, ...], chunks: list[_Chunk]) -> tuple[str, list[_Chunk]] | None:
    """What is wrong with ``chunks`` as a tiling of ``shape``: a message (``{}`` for each chunk named) and the
    chunks it names; ``None`` if they tile it exactly."""
    for chunk in chunks:
        offsets, sizes = chunk
        empty = 0 in sizes  # holds nothing (a rank with no rows of a small tensor): its offsets do not matter
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(s < 0 for s in sizes)
            or (not empty and any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)))
        ):
            return "include {}, outside the tensor's shape", [chunk]
    pair = _overlapping(shape, chunks)
    if pair is not None:
        return "overlap: {} and {} both hold some of its elements", list(pair)
    covered, total = sum(_numel(s) for _, s in chunks), _numel(shape)
    if covered != total:
        return f"cover only {covered} of its {total} elements: a gap, whose data was never stored", []
    return None


def _overlapping(shape: tuple[int, ...], chunks: list[_Chunk]) -> tuple[_Chunk, _Chunk] | None:
    """Two chunks sharing an element, if any: a sweep along the dimension with the most distinct offsets."""
    boxes = [c for c in chunks if all(s > 0 for s in c[1])]
    if len(boxes) < 2:
        return None
    if not shape:  # two chunks of a 0-d tensor are the same element
        return boxes[0], boxes[1]
    dim = max(range(len(shape)), key=lambda d: len({c[0][d] for c in boxes}))
    boxes.sort(key=lambda c: c[0][dim])
    active: list[_Chunk] = []
    for box in boxes:
        start = box[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        for other in active:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(other[0], other[1], box[0], box[1])
            ):
                return other, box
        active.append(box)
    return None


# ---------------------------------------------------------------------------------------------- dtypes
def dtype_kind(dtype: torch.dtype) -> str:
    """``bool``, ``integer``, ``floating point`` or ``complex``: loading casts within a kind, not across."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


def check_dtype_kinds(
    path: object, pairs: Iterable[tuple[str, torch.dtype, torch.dtype]], allow: bool
) -> None:
    """Raise before anything is applied if a stored tensor (``(key, stored dtype, dtype it loads into)``)
    is of another kind than what it loads into (an integer into a floating-point parameter, or the reverse;
    bool likewise), unless ``allow`` (the ``allow_dtype_kind_cast`` opt-in). A cast within a kind
    (float32 -> bfloat16) is never refused."""
    if allow:
        return
    bad = [(k, s, t) for k, s, t in pairs if dtype_kind(s) != dtype_kind(t)]
    if not bad:
        return
    shown = "; ".join(
        f"{k!r} is stored as {s} ({dtype_kind(s)}) and would load into {t} ({dtype_kind(t)})"
        for k, s, t in bad[:8]
    )
    more = f" ({len(bad)} in all)" if len(bad) > 8 else ""
    raise CheckpointError(
        f"Checkpoint {path}: {shown}{more}. HINT: load a checkpoint of this model; to cast across kinds anyway, "
        "pass allow_dtype_kind_cast=True (to flatshard.load_checkpoint, or to the strategy). Nothing was loaded."
    )


def check_state_dict_kinds(path: object, module: Any, state_dict: Mapping[str, Any], allow: bool) -> None:
    """:func:`check_dtype_kinds` for a full state dict loading into ``module`` (the keys both have)."""
    own = module.state_dict(keep_vars=True)
    kinds = [
        (key, value.dtype, own[key].dtype)
        for key, value in state_dict.items()
        if isinstance(value, torch.Tensor) and isinstance(own.get(key), torch.Tensor)
    ]
    check_dtype_kinds(path, kinds, allow)


def check_optim_state_kinds(path: object, optimizer: Any, state_dict: Any, allow: bool) -> None:
    """:func:`check_dtype_kinds` for a full optimizer state dict loading into ``optimizer``: each per-element
    state (``exp_avg``, ``momentum_buffer``: a tensor of more than 0 dimensions) against its parameter's
    dtype. Scalars (``step``) keep their own dtype and are not checked. Parameters are matched by position
    in the groups, as ``Optimizer.load_state_dict`` does."""
    if allow or not isinstance(state_dict, Mapping):
        return
    states, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(states, Mapping) or not isinstance(groups, list):
        return  # not an optimizer state dict: the conversion reports it
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in groups if isinstance(group, Mapping) for i in group.get("params", [])]
    kinds = [
        (f"state {key!r} of parameter #{pos}", value.dtype, params[pos].dtype)
        for pos, saved_id in enumerate(saved[: len(params)])
        if isinstance(states.get(saved_id), Mapping)
        for key, value in states[saved_id].items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    check_dtype_kinds(path, kinds, allow)
