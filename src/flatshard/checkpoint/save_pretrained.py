"""``save_pretrained``: a sharded module's weights as a Hugging Face model directory, gathered unit by unit.

[Note: save_pretrained]
Every rank calls it. The files are planned first, on every rank alike, from the names, dtypes and shapes of the
full state dict (:func:`~flatshard.engine.full_entries`: no communication), as transformers' ``save_pretrained``
plans them (see [Note: Hugging Face model directory]). Then the units are gathered one at a time by the same
streamed gather a full checkpoint save uses (see [Note: streamed full saves]) and rank 0 hands each full tensor to
a :class:`~flatshard.checkpoint.hf_export.PretrainedWriter` and drops it; each file lays its tensors out in the
order the gather delivers them, so rank 0 holds about one unit's full tensors at a time. Buffers and parameters
outside every unit come last (every rank has them whole).

A write that fails on rank 0 stops the writing, not the gathering (its peers are in those collectives); then
the export fails on every rank through the save round (see [Note: save outcomes through the store]) and what it
wrote is removed. Arguments that cannot work (a file where the directory should be, a sharded checkpoint there,
an unreachable URL, a prefix that selects nothing) are refused on every rank before anything is gathered.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.hf_conversions import Reverted, reverted
from flatshard.checkpoint.hf_export import (
    DEFAULT_MAX_SHARD_SIZE,
    PretrainedWriter,
    TensorSpec,
    parse_dtype,
    parse_max_shard_size,
    plan_shards,
)
from flatshard.checkpoint.safetensors_format import CODES
from flatshard.checkpoint.save_round import SaveRound, gather_for_save
from flatshard.checkpoint.storage import Remote, locate_checked
from flatshard.engine import FullEntry, FullStates, full_entries, global_rank, unit_states

__all__ = ["save_pretrained"]


def save_pretrained(
    module: nn.Module,
    out_dir: str | os.PathLike[str] | Remote,
    *,
    prefix: str = "",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
) -> Path | str:
    """Write ``module``'s weights to ``out_dir`` in Hugging Face's layout: ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` (see [Note: save_pretrained]).

    Collective: every rank calls it; rank 0 writes. Works for a module sharded by :func:`flatshard.shard` (or
    holding sharded submodules, as a LightningModule does), for a plain module, and on one process without
    ``torch.distributed``. Only the weights are written: put the config beside them with
    ``config.save_pretrained(out_dir)``. Files already in ``out_dir`` (config, tokenizer, README) are kept; the
    weight files of an earlier export are replaced. ``out_dir`` changes only once every file is written.

    Args:
        module: the module.
        out_dir: the directory, a local path or an fsspec URL (``s3://bucket/models/run1``).
        prefix: keep only the state-dict names that start with it, with it removed (default ``""``: all).
            ``"model."`` writes a LightningModule's ``self.model``.
        max_shard_size: the size limit per file: bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` (default ``"5GB"``,
            as transformers). A tensor larger than the limit gets a file of its own.
        dtype: cast floating-point tensors to this dtype (``torch.bfloat16`` or ``"bfloat16"``; default: each
            tensor's own dtype).

    Returns:
        The directory (the URL for a URL).

    Names are the module's state-dict names: buffers that are not persistent are not written, tied weights (one
    Parameter under several names) once under the first name (for a transformers model the name its
    ``save_pretrained`` keeps, the embedding; ``from_pretrained`` ties the others again), and entries that are not
    tensors (``_extra_state`` objects) are left out.
    """
    limit = parse_max_shard_size(max_shard_size)
    cast = parse_dtype(dtype)
    location = locate_checked(out_dir)
    keep = global_rank() == 0
    states = None
    if unit_states(module):
        with gather_for_save(location):
            states = FullStates([(module, None)], keep=keep)  # refuses a module that cannot be saved now
    entries = full_entries(module)
    names, specs, arrival = _select(entries, prefix, cast, type(module).__name__)
    reverse = reverted(module, prefix, [(s.name, s.dtype, s.shape) for s in specs])
    if (
        reverse is not None
    ):  # the names and layout transformers writes: see [Note: transformers' weight conversions]
        specs, arrival = _reverted_specs(reverse, specs, arrival)
    plan = plan_shards(specs, limit, arrival)
    parameters = sum(e.shape.numel() for e in entries if e.key in names and e.parameter)
    opened: list[PretrainedWriter] = []

    def open_writer() -> None:  # rank 0: its refusal (a file in the way) reaches every rank before any gather
        opened.append(PretrainedWriter(location, plan, index_metadata={"total_parameters": parameters}))

    try:
        round_ = SaveRound("The Hugging Face export", location, open_writer if keep else None)
    except BaseException:  # refused, or the opening collective failed: nothing may stay behind
        for opened_writer in opened:
            opened_writer.abort()
        raise
    with round_:
        writer = opened[0] if opened else None
        if writer is not None:
            round_.on_failure(writer.abort)
        _stream(module, states, writer, names, cast, reverse)
        if writer is not None:
            writer.finish()
            round_.committed()
        round_.agree("written")
    return location if isinstance(location, Path) else location.url


def _select(
    entries: Sequence[FullEntry], prefix: str, cast: torch.dtype | None, what: str
) -> tuple[dict[str, str], list[TensorSpec], dict[str, int]]:
    """``{state-dict key: name written}`` (one key per tensor), the tensors to write and their arrival order.

    Raises :class:`CheckpointError` for a prefix that selects nothing or leaves bad names, and for a dtype
    safetensors cannot store; the same on every rank.
    """
    keys = [e for e in entries if e.key.startswith(prefix)]
    if not keys:
        present = list(dict.fromkeys(e.key.split(".", 1)[0] + ("." if "." in e.key else "") for e in entries))
        raise CheckpointError(
            f"save_pretrained: no state-dict name of {what} starts with the prefix {prefix!r}. The prefixes "
            f"present: {present[:10]}. HINT: pass one of them (with its trailing '.') or no prefix."
        )
    bad = [e.key for e in keys if not e.key[len(prefix) :] or e.key[len(prefix) :].startswith(".")]
    if bad:
        raise CheckpointError(
            f"save_pretrained: the prefix {prefix!r} leaves names that are empty or start with '.' ({bad[:3]}). "
            f"HINT: end the prefix with '.', e.g. {prefix.rstrip('.') + '.'!r}."
        )
    names: dict[str, str] = {}
    specs: list[TensorSpec] = []
    arrival: dict[str, int] = {}
    stored: set[str] = set()  # the first key of each tensor written
    for e in keys:
        if e.first in stored:  # tied: written once, under the first name selected
            continue
        stored.add(e.first)
        dtype = cast if cast is not None and e.dtype.is_floating_point else e.dtype
        if dtype not in CODES:
            raise CheckpointError(
                f"save_pretrained: {e.key!r} of {what} has dtype {e.dtype}, which safetensors cannot store. HINT: "
                "save it with flatshard.save_checkpoint instead, or pass dtype= for floating-point tensors."
            )
        name = e.key[len(prefix) :]
        names[e.key] = name
        specs.append(TensorSpec(name, dtype, tuple(int(d) for d in e.shape)))
        arrival[name] = e.arrival
    return names, specs, arrival


def _stream(
    module: nn.Module,
    states: FullStates | None,
    writer: PretrainedWriter | None,
    names: dict[str, str],
    cast: torch.dtype | None,
    reverse: Reverted | None = None,
) -> None:
    """Gather unit by unit on every rank; rank 0 (given ``writer``) writes. A write that fails stops the writing,
    not the gathering: the peers are in those collectives, so rank 0 raises only once they are all done."""
    failure: list[BaseException] = []

    def put(key: str, tensor: torch.Tensor) -> None:
        if writer is None or failure:
            return
        try:
            if cast is not None and tensor.is_floating_point():
                tensor = tensor.to(cast)
            if reverse is None:
                writer.write(names[key], tensor)
                return
            for name, value in reverse.put(names[key], tensor):
                writer.write(name, value.contiguous())
        except Exception as err:
            failure.append(err)

    def consume(tensor: torch.Tensor, target: int, keys: tuple[str, ...]) -> None:
        key = next((k for k in keys if k in names), None)
        if key is not None:
            put(key, tensor)

    whole: dict[str, Any] = {}
    if states is not None:
        (whole,) = states.gather(consume)  # gathered entries come back as None, the others whole
    elif writer is not None:
        whole = module.state_dict()
    for key in names:
        value = whole.get(key)
        if isinstance(value, torch.Tensor):
            put(key, value)
    if failure:
        raise failure[0]


def _reverted_specs(
    reverse: Reverted, specs: list[TensorSpec], arrival: dict[str, int]
) -> tuple[list[TensorSpec], dict[str, int]]:
    """The tensors written after transformers' reversed conversions, each arriving with its group's last input."""
    out: list[TensorSpec] = []
    order: dict[str, int] = {}
    done: set[str] = set()
    for spec in specs:
        group = reverse.groups[spec.name]
        if group.first in done:
            continue
        done.add(group.first)
        last = max(arrival[name] for name, _ in group.inputs)
        for name, dtype, shape in reverse.outputs[group.first]:
            out.append(TensorSpec(name, dtype, shape))
            order[name] = last
    return out, order
