"""``load_pretrained``: a Hugging Face checkpoint into a sharded (or unsharded) module, each rank reading only
the byte ranges of what it keeps.

[Note: loading pretrained weights]
Every rank opens the checkpoint (headers only: names, dtypes, shapes, byte ranges; see
``flatshard/checkpoint/hf_source.py``) and matches it against the module's state-dict names:

- ``prefix`` is taken off the module's names (a LightningModule's ``model.model.layers.0...`` against the
  checkpoint's ``model.layers.0...`` with ``prefix="model."``); names outside the prefix are not part of the
  load. A ``peft`` model's names map to its base model's (``.base_layer`` dropped, ``modules_to_save`` and
  ``original_module`` copies read from the base name); adapter weights are not in a base checkpoint.
- A tied parameter (one ``Parameter`` under several names, as ``from_pretrained`` ties the head to the
  embedding) is read once, from whichever of its names the checkpoint holds.
- ``strict`` reports names of the module missing from the checkpoint and names of the checkpoint that nothing
  takes (except those a Hugging Face model declares ignorable, ``_keys_to_ignore_on_load_unexpected``, and old
  rotary ``inv_freq`` entries); a shape mismatch is always an error.

All of that, and the checkpoint's own checks (a damaged or truncated file, an index naming a missing file, an
unreachable URL), happen on every rank before anything is read, and every rank raises if any rank found a
problem: **no weight changes**. Then each rank reads, for each parameter of a unit, the contiguous range of
its flattened elements that the rank's shard holds, straight into the shard (staged through at most
``_STAGING_BYTES`` when the dtype is cast or the shard is on an accelerator); buffers and parameters that no
unit manages are read whole. No rank holds more than its shard and the staging buffer: the model never exists
in full. The loaded parameters count as filled (see [Note: unfilled tensors]); a read that fails half-way
(an I/O error after the checks) raises on every rank and leaves every parameter of this load unfilled, so a
forward refuses instead of computing with half a model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.hf_conversions import ConvertedGroup, conversions
from flatshard.checkpoint.hf_source import PretrainedSource, SourceTensor, open_source
from flatshard.checkpoint.validate import agree_on_error
from flatshard.engine import (
    Initializers,
    Materialized,
    adapters_of,
    handle_of_param,
    hf_owners,
    materialize_modules,
    prepare_for_state_io,
    unit_states,
)

__all__ = ["PretrainedLoad", "load_pretrained"]

_STAGING_BYTES = 64 * 2**20  # at most this much is read into a staging buffer before it is copied in
_INV_FREQ = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # old checkpoints hold these; the model computes them


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did (on this rank)."""

    source: str
    loaded: list[str]  # the module's names that were filled (all names of a tied parameter)
    missing: list[str]  # the module's names (under the prefix) the checkpoint lacks (strict=False)
    unexpected: list[str]  # checkpoint names nothing took (strict=False)
    bytes_read: int  # checkpoint data bytes this rank read
    notes: list[str] = field(default_factory=list)


@dataclass
class _Target:
    """One tensor of the module to fill: the live tensor, its names and the checkpoint entry chosen."""

    value: torch.Tensor
    names: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)  # checkpoint names, in preference order
    source: SourceTensor | None = None
    converted: tuple[ConvertedGroup, str] | None = (
        None  # or built by a converter: the group, the name it gives
    )

    @property
    def found(self) -> bool:
        return self.source is not None or self.converted is not None


def load_pretrained(
    module: nn.Module, source: str | os.PathLike[str], *, prefix: str = "", strict: bool = True
) -> PretrainedLoad:
    """Fill ``module``'s parameters and buffers from a Hugging Face checkpoint; every rank calls it.

    Args:
        module: a module sharded by :func:`flatshard.shard` (any sharding strategy, world size, wrap policy),
            or an unsharded one; built on the meta device or not.
        source: a Hugging Face model directory (``model.safetensors``, or ``model.safetensors.index.json`` and
            its files; ``pytorch_model.bin`` and its index too), a ``.safetensors`` file or an index, as a
            local path or any fsspec URL.
        prefix: taken off the module's names to get the checkpoint's (``"model."`` for a LightningModule
            holding the Hugging Face model as ``self.model``).
        strict: raise on module names the checkpoint lacks and checkpoint names nothing takes.

    Returns:
        A :class:`PretrainedLoad` naming what was loaded, missing and unexpected, and the bytes read.

    Raises:
        CheckpointError: on every rank, before any weight changes, for a missing, damaged or truncated file,
            an unreachable URL, a shape mismatch, or (``strict``) missing and unexpected names.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_pretrained takes an nn.Module, got {type(module).__name__}.")
    error: BaseException | None = None
    src: PretrainedSource | None = None
    targets: list[_Target] = []
    missing: list[str] = []
    unexpected: list[str] = []
    try:
        sharded = bool(unit_states(module))
        if sharded:
            prepare_for_state_io(module, "load_pretrained")
        src = open_source(source)
        targets, missing, unexpected = _match(module, src, prefix)
        _check(src, targets, missing, unexpected, strict, prefix, module)
    except (CheckpointError, FileNotFoundError, OSError) as err:
        error = err if isinstance(err, CheckpointError) else CheckpointError(str(err))
    except ValueError as err:
        error = CheckpointError(str(err))
    try:
        agree_on_error(error, "load_pretrained")
    except BaseException:
        if src is not None:
            src.close()
        raise
    assert src is not None
    with src:
        if not sharded:
            _materialize_whole(module)
            targets = _retarget(module, targets)
        failure: BaseException | None = None
        try:
            _read(src, targets)
            _read_converted(src, targets)
        except (CheckpointError, OSError, RuntimeError, ValueError) as err:
            failure = err if isinstance(err, CheckpointError) else CheckpointError(f"{src.location}: {err}")
        _settle(targets, failed=_any_failed(failure))
        agree_on_error(failure, "load_pretrained (reading)")
        return PretrainedLoad(
            source=src.location,
            loaded=[n for t in targets if t.found for n in t.names],
            missing=missing,
            unexpected=unexpected,
            bytes_read=src.bytes_read,
            notes=list(src.notes) + _conversion_notes(targets),
        )


# ---------------------------------------------------------------------------------------------- matching
def checkpoint_names(name: str) -> list[str]:
    """The checkpoint names a module name (the prefix already taken off) may be stored under, preferred
    first: itself, and for ``peft`` models the base model's name."""
    base = name.replace(".base_layer.", ".")
    base = re.sub(r"\.modules_to_save\.[^.]+\.", ".", base)
    base = base.replace(".original_module.", ".")
    if base.startswith("base_model.model."):  # a PeftModel given whole, prefix left empty
        base = base[len("base_model.model.") :]
    return [name] if base == name else [base, name]


def _match(
    module: nn.Module, src: PretrainedSource, prefix: str
) -> tuple[list[_Target], list[str], list[str]]:
    by_tensor: dict[int, _Target] = {}
    adapter_weights = {  # peft adapters: initialized by peft, never in a base checkpoint
        id(t)
        for holder in adapters_of(module)
        for t in (*holder._parameters.values(), *holder._buffers.values())
    }
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or not key.startswith(prefix) or id(value) in adapter_weights:
            continue
        target = by_tensor.setdefault(id(value), _Target(value))
        target.names.append(key)
        for name in checkpoint_names(key[len(prefix) :]):
            if name not in target.candidates:
                target.candidates.append(name)
    if prefix and not by_tensor:
        tops = sorted({k.split(".", 1)[0] + "." for k in module.state_dict()})
        raise CheckpointError(
            f"No name of {type(module).__name__} starts with prefix {prefix!r}. HINT: the module's names start "
            f"with {', '.join(tops[:8])}; pass the part before the checkpoint's names as prefix."
        )
    targets = list(by_tensor.values())
    # names transformers renames or converts (see [Note: transformers' weight conversions])
    conv = conversions(module, [c for t in targets for c in t.candidates], src.tensors)
    taken: set[str] = set()
    missing: list[str] = []
    for t in targets:
        stored = [c for c in t.candidates if c in src.tensors]
        stored += [conv.renamed[c] for c in t.candidates if c in conv.renamed]
        t.source = src.tensors[stored[0]] if stored else None
        taken.update(stored)  # a tied tensor's other stored name too
        if t.source is None:
            built = next((c for c in t.candidates if c in conv.groups), None)
            if built is not None:
                t.converted = (conv.groups[built], built)
                taken.update(conv.groups[built].sources_names())
        if not t.found:
            missing.append(t.names[0])
    ignore_missing, ignore_unexpected = _hf_ignore_patterns(module)
    missing = [n for n in missing if not any(p.search(n[len(prefix) :]) for p in ignore_missing)]
    unexpected = [
        n
        for n in src.tensors
        if n not in taken and not _INV_FREQ.search(n) and not any(p.search(n) for p in ignore_unexpected)
    ]
    return targets, missing, unexpected


def _hf_ignore_patterns(module: nn.Module) -> tuple[list[re.Pattern[str]], list[re.Pattern[str]]]:
    """The name patterns Hugging Face models under ``module`` declare safe to be missing or unexpected."""
    missing: list[re.Pattern[str]] = []
    unexpected: list[re.Pattern[str]] = []
    for m in {id(o): o for o in hf_owners(module).values()}.values():
        missing += [re.compile(p) for p in getattr(m, "_keys_to_ignore_on_load_missing", None) or []]
        unexpected += [re.compile(p) for p in getattr(m, "_keys_to_ignore_on_load_unexpected", None) or []]
    return missing, unexpected


def _check(
    src: PretrainedSource,
    targets: list[_Target],
    missing: list[str],
    unexpected: list[str],
    strict: bool,
    prefix: str,
    module: nn.Module,
) -> None:
    wrong = []
    for t in targets:
        if t.converted is not None:
            group, name = t.converted
            if tuple(group.shapes[name]) != tuple(_full_shape(t.value)):
                wrong.append(
                    f"{name!r} converted from {', '.join(repr(n) for n in group.sources_names()[:3])} is "
                    f"{list(group.shapes[name])}, {t.names[0]!r} is {list(_full_shape(t.value))}"
                )
            continue
        if t.source is None:
            continue
        shape = _full_shape(t.value)
        if tuple(shape) != tuple(t.source.shape):
            wrong.append(
                f"{t.source.name!r} in {t.source.file} is {list(t.source.shape)}, {t.names[0]!r} is {list(shape)}"
            )
        if t.source.dtype.is_complex != t.value.dtype.is_complex:
            wrong.append(
                f"{t.source.name!r} in {t.source.file} is {t.source.dtype}, {t.names[0]!r} is {t.value.dtype}"
            )
    if wrong:
        raise CheckpointError(
            f"{src.location} does not fit {type(module).__name__}: "
            + "; ".join(wrong[:5])
            + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
            + ". HINT: build the model from the checkpoint's own config.json. Nothing was loaded."
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_short(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the model: {_short(unexpected)}")
        hint = (
            f"check prefix={prefix!r} (the module's names minus the prefix must be the checkpoint's)"
            if not (missing and unexpected) or prefix
            else "pass prefix= when the model sits inside another module (prefix='model.' for self.model)"
        )
        raise CheckpointError(
            f"{src.location} and {type(module).__name__} do not match: {'; '.join(parts)}. HINT: {hint}, or pass "
            "strict=False to load what matches. Nothing was loaded."
        )


def _full_shape(value: torch.Tensor) -> torch.Size:
    handle = handle_of_param(value)
    if handle is None:
        return value.shape
    return handle.full_shape(handle.index_of(value))


def _short(names: list[str], limit: int = 6) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )


# ---------------------------------------------------------------------------------------------- unsharded
def _materialize_whole(module: nn.Module) -> None:
    """Storage for an unsharded module's meta tensors (on the device its other tensors use, else the CPU),
    ties kept; buffers get the values :mod:`~flatshard.engine.setup.materialize` gives them."""
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, attr))
    names = {m: n or "<root>" for n, m in module.named_modules()}
    materialize_modules(
        list(module.modules()), device, None, names, Initializers.of(module), Materialized(), False
    )
    for places in holders.values():  # re-tie: each holder got a tensor of its own
        first_module, first_attr = places[0]
        for m, attr in places[1:]:
            m._parameters[attr] = first_module._parameters[first_attr]


def _retarget(module: nn.Module, targets: list[_Target]) -> list[_Target]:
    """The targets again after materializing replaced the meta tensors (found by their first name)."""
    live = module.state_dict(keep_vars=True)
    for t in targets:
        t.value = live[t.names[0]]
    return targets


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class _Piece:
    source: SourceTensor
    first: int  # first element of the flattened tensor
    dest: torch.Tensor  # 1-D, where the elements go (any dtype and device)


def _destinations(t: _Target) -> list[tuple[int, torch.Tensor]]:
    """Where this rank keeps ``t``'s elements: per range of the flattened tensor it keeps, its first element and
    a 1-D tensor (any dtype and device); none where it keeps nothing. A tensor-parallel piece is a range of its
    block, which lies in the whole tensor as one range per row (see [Note: tensor parallelism])."""
    handle = handle_of_param(t.value)
    if handle is None:
        dest = t.value.detach()
        if not dest.is_contiguous():
            raise CheckpointError(
                f"{t.names[0]!r} is not contiguous; load_pretrained writes contiguous tensors."
            )
        return [(0, dest.reshape(-1))]
    i = handle.index_of(t.value)
    info = handle.shard_infos[i]
    if not info.numel_in_shard:
        return []
    dest = handle.sharded[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
    layout = handle.tensor_parallel[i] if handle.tensor_parallel is not None else None
    if layout is None:
        return [(info.offset_in_param, dest)]
    return [
        (first, dest[at : at + n])
        for first, at, n in _runs(layout.shape, layout.block(), info.offset_in_param, dest.numel())
    ]


def _runs(
    shape: Sequence[int], block: tuple[tuple[int, ...], tuple[int, ...]], start: int, n: int
) -> list[tuple[int, int, int]]:
    """The range ``[start, start + n)`` of a block's flattening as ranges of the whole tensor's flattening:
    ``(first element in the whole tensor, offset in the range, length)``, adjacent ones merged."""
    at, sizes = block
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    runs: list[list[int]] = []
    pos, end = start, start + n
    while pos < end:
        index, rest = [], pos
        for size in reversed(sizes):
            rest, i = divmod(rest, int(size))
            index.append(i)
        index.reverse()
        length = min(int(sizes[-1]) - index[-1], end - pos)
        first = sum((a + i) * s for a, i, s in zip(at, index, strides, strict=True))
        if runs and runs[-1][0] + runs[-1][2] == first:
            runs[-1][2] += length
        else:
            runs.append([first, pos - start, length])
        pos += length
    return [(first, offset, length) for first, offset, length in runs]


def _pieces(targets: list[_Target]) -> list[_Piece]:
    out: list[_Piece] = []
    for t in targets:
        if t.source is None:
            continue
        out += [_Piece(t.source, first, dest) for first, dest in _destinations(t)]
    return out


def _read_converted(src: PretrainedSource, targets: list[_Target]) -> None:
    """Fill the targets that transformers' converters build (see [Note: transformers' weight conversions]): per
    group with a target this rank keeps part of, its sources read whole, converted, and the ranges copied."""
    wanted: dict[int, tuple[ConvertedGroup, list[tuple[str, int, torch.Tensor]]]] = {}
    for t in targets:
        if t.converted is None:
            continue
        group, name = t.converted
        for first, dest in _destinations(t):
            wanted.setdefault(id(group), (group, []))[1].append((name, first, dest))

    def whole(tensor: SourceTensor) -> torch.Tensor:
        out = torch.empty(tensor.numel, dtype=tensor.dtype)
        src.read([(tensor, 0, out)])
        return out.view(tensor.shape)

    with torch.no_grad():
        for group, places in wanted.values():
            built = group.convert(whole)
            for name, first, dest in places:
                flat = built[name].reshape(-1)
                dest.copy_(flat[first : first + dest.numel()])
            del built


def _read(src: PretrainedSource, targets: list[_Target]) -> None:
    """Read every piece: straight into its destination when the dtype matches and it is CPU memory, else
    through a staging buffer of at most ``_STAGING_BYTES``, in file order."""
    pieces = sorted(_pieces(targets), key=lambda p: (p.source.file, p.source.name, p.first))
    direct: list[tuple[SourceTensor, int, torch.Tensor]] = []
    with torch.no_grad():
        for p in pieces:
            if p.dest.dtype == p.source.dtype and p.dest.device.type == "cpu" and p.dest.is_contiguous():
                direct.append((p.source, p.first, p.dest))
        if direct:
            src.read(direct)
            # written by pointer, unseen by torch: bump the shards' version counters as torch asks of such writers
            # (whole-tensor optimizers' owners then know their copies are stale: [Note: whole-tensor optimizers])
            torch.autograd.graph.increment_version([dest for _, _, dest in direct])
        for p in pieces:
            if p.dest.dtype == p.source.dtype and p.dest.device.type == "cpu" and p.dest.is_contiguous():
                continue
            step = max(1, _STAGING_BYTES // max(1, p.source.dtype.itemsize))
            n = p.dest.numel()
            for start in range(0, n, step):
                count = min(step, n - start)
                staged = torch.empty(count, dtype=p.source.dtype)
                src.read([(p.source, p.first + start, staged)])
                p.dest[start : start + count].copy_(staged)


def _any_failed(failure: BaseException | None) -> bool:
    """Whether a read failed on any rank (every rank then forgets what this load wrote)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, failure is not None)
        return any(flags)
    return failure is not None


def _settle(targets: list[_Target], failed: bool) -> None:
    """Record the loaded parameters as filled, or (a read failed somewhere) every one of this load as
    unfilled again (see [Note: unfilled tensors])."""
    for t in targets:
        if not t.found:
            continue
        handle = handle_of_param(t.value)
        if handle is None:
            continue
        i = handle.index_of(t.value)
        if failed:
            handle.unfilled.add(i)
        else:
            handle.mark_filled(i)


def _conversion_notes(targets: list[_Target]) -> list[str]:
    groups = {id(t.converted[0]): t.converted[0] for t in targets if t.converted is not None}
    if not groups:
        return []
    names = [g.first for g in groups.values()]
    return [
        f"{len(names)} tensors are built by transformers' conversions from several checkpoint tensors "
        f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}): a rank keeping part of one reads its "
        "sources whole"
    ]
