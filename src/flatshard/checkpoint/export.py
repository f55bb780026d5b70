"""``export_safetensors``: a checkpoint's model weights as one ``.safetensors`` file, for inference tools.

[Note: safetensors export]
A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape
and byte range, and a ``__metadata__`` map of strings), then the tensors' bytes back to back. It is written
here directly, one tensor at a time, not through ``safetensors.torch.save_file``: exporting needs no extra
package; a sharded directory is read in batches of about ``_BATCH_BYTES`` and written as it is read (the
header comes from the directory's metadata before any data is read), so a model larger than memory exports;
and the progress bar follows the bytes written. The safetensors package reads the result
(:func:`load_safetensors` uses it, and the tests check the files with it and with ``from_pretrained``).

What is written:

- the checkpoint's model state (``state_dict``) under its original names or, with ``ema``, the EMA weights a
  ``ShardedEMA`` callback saved: ``checkpoint["callbacks"][<key starting with "ShardedEMA">]["ema_state_dict"]``,
  a mapping from the model's state-dict names to tensors. Names the EMA state lacks (buffers) keep the
  checkpoint's values, with a note; a name tied to one the EMA holds takes the EMA value.
- with ``prefix``, only the names that start with it, the prefix removed (``"model."`` turns a
  LightningModule's keys into those of the model it holds).
- tied weights once: names of one tensor (the same storage, offset, shape and strides in a file; the recorded
  aliases in a sharded directory) are stored under the first name in state-dict order, which for Hugging Face
  models is the name ``save_pretrained`` keeps (the embedding, not the head). The others go into the
  metadata entry ``flatshard.aliases``, JSON ``{name: stored name}``: :func:`load_safetensors` restores them
  as one tensor; ``safetensors.torch.load_file`` returns the stored names only, and ``from_pretrained``
  re-ties the rest. Views that only overlap are stored as separate tensors.
- every tensor contiguous; entries that are not tensors (``_extra_state`` objects) left out, with a note.
- every dtype of the safetensors specification, by the codes of
  :mod:`~flatshard.checkpoint.safetensors_format` (float8 and float4 included). A tensor of any other dtype
  (complex32, complex128, quantized, bits, uint1-7 / int1-7) is refused before the file is created, with a hint
  to export to ``.ckpt``, which keeps every dtype ``torch.save`` stores.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from flatshard.checkpoint.directory import ShardedReader, is_sharded_checkpoint
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.files import load_checkpoint_file, write_offline
from flatshard.checkpoint.mapped import MappedPages
from flatshard.checkpoint.safetensors_format import CODES, encode_header
from flatshard.checkpoint.storage import Remote, is_url, locate, locate_checked
from flatshard.engine import ParamShard
from flatshard.version import __version__

__all__ = [
    "ALIASES_KEY",
    "DIRECTORY",
    "SUFFIXES",
    "ExportResult",
    "Progress",
    "export_safetensors",
    "is_directory_output",
    "load_safetensors",
    "open_state",
    "output_format",
    "read_tensors",
    "select_entries",
    "with_ema",
]

SUFFIXES = (".ckpt", ".safetensors")  # what ``flatshard consolidate`` writes, chosen by OUT's suffix
DIRECTORY = "/"  # ... or, for an OUT ending in "/", a Hugging Face model directory
ALIASES_KEY = "flatshard.aliases"  # metadata entry: JSON {tied name: the name its tensor is stored under}
EMA_KEY_PREFIX = "ShardedEMA"  # callback state keys holding EMA weights start with this
EMA_ENTRY = "ema_state_dict"  # ... and hold them under this entry
PROGRESS_MIN_BYTES = 256 * 2**20  # smaller exports finish too fast for a progress bar to help
_BATCH_BYTES = 256 * 2**20  # a sharded directory is read in batches of about this size
_CHUNK_BYTES = 16 * 2**20  # largest single write (and progress step)
_PIP_HINT = "pip install safetensors"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_safetensors` wrote.

    Attributes:
        path: the file written (the URL for a URL).
        tensors: how many tensors it stores.
        nbytes: the tensors' bytes.
        aliases: ``{tied name: stored name}`` of the names stored once (also in the file's metadata).
        notes: what was left out or taken from elsewhere, one sentence each.
    """

    path: Path | str
    tensors: int
    nbytes: int
    aliases: dict[str, str]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Stored:
    """A tensor in a sharded directory, not read yet."""

    fqn: str
    dtype: torch.dtype
    shape: torch.Size
    piece: bool  # stored flat, in pieces (read as a ParamShard)


@dataclass(frozen=True)
class _NotTensor:
    """An entry that is not a tensor: left out, with a note."""

    what: str


@dataclass
class _State:
    """A checkpoint's model state before anything large is read."""

    path: str  # for messages
    values: dict[str, Any]  # key -> torch.Tensor | _Stored | _NotTensor, in state-dict order
    ties: dict[str, str]  # key -> an earlier key of the same tensor
    extra: Mapping[str, Any]  # the rest of the checkpoint (callbacks, epoch, ...)
    reader: ShardedReader | None
    notes: list[str]
    pages: MappedPages | None = (
        None  # a local full file's mapping: see [Note: reading a full file by byte ranges]
    )


@dataclass(frozen=True)
class _Entry:
    name: str  # as written
    value: torch.Tensor | _Stored
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def output_format(out: str | os.PathLike[str] | Remote) -> str:
    """What ``flatshard consolidate`` writes at ``out``: ``".ckpt"`` or ``".safetensors"`` (its suffix), or
    ``DIRECTORY`` (``"/"``) for a Hugging Face model directory: ``out`` ends in ``/`` or is an existing local
    directory whose name has neither suffix. Raises for anything else."""
    name = out.url if isinstance(out, Remote) else os.fspath(out)
    if is_directory_output(out):
        return DIRECTORY
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in SUFFIXES:
        raise CheckpointError(
            f"Cannot write {name}: unknown output format {suffix or '(no suffix)'!r}. HINT: end the name with one "
            "of the supported suffixes: .ckpt (the full Lightning checkpoint), .safetensors (the model weights "
            "only, for inference tools), or with '/' for a Hugging Face model directory (model.safetensors or "
            "model-0000k-of-0000n.safetensors and their index)."
        )
    return suffix


def is_directory_output(out: str | os.PathLike[str] | Remote) -> bool:
    """Whether ``out`` names a Hugging Face model directory for ``flatshard consolidate``: it ends in ``/``, or is
    an existing local directory whose name has no suffix of :data:`SUFFIXES` (that one is refused as before)."""
    if isinstance(out, Remote):
        return False  # its URL has lost any trailing "/"
    name = os.fspath(out)
    if name.endswith(("/", os.sep)):
        return True
    return os.path.splitext(name)[1].lower() not in SUFFIXES and not is_url(name) and os.path.isdir(name)


def export_safetensors(
    src: str | os.PathLike[str] | Remote,
    out: str | os.PathLike[str] | Remote,
    *,
    prefix: str = "",
    ema: bool | str = False,
    progress: bool = False,
) -> ExportResult:
    """Write the model weights of a checkpoint to one ``.safetensors`` file (see [Note: safetensors export]).

    Runs on one process, with no process group. ``out`` is replaced atomically if it exists.

    Args:
        src: a sharded checkpoint directory or a full checkpoint file, a local path or an fsspec URL.
        out: the ``.safetensors`` file to write, a local path or an fsspec URL.
        prefix: keep only the state-dict names that start with it, with it removed (default ``""``: all).
            ``"model."`` gives the weights of a LightningModule's ``self.model``.
        ema: ``True`` exports the EMA weights of the checkpoint's ``ShardedEMA`` callback state instead of the
            trained weights; a string names the callback state key when there are several (default ``False``).
        progress: show a progress bar on stderr for exports of at least 256 MiB (default ``False``; the
            ``flatshard`` command shows it when stderr is a terminal).

    Returns:
        An :class:`ExportResult`: the path, the tensors and bytes written, the tied names and the notes.
    """
    if output_format(out) != ".safetensors":
        raise CheckpointError(
            f"export_safetensors writes a .safetensors file, not {out}. HINT: end it in .safetensors."
        )
    target = locate_checked(out)  # an unreachable destination fails before anything is read
    state, entries, aliases = open_entries(src, prefix, ema, "export_safetensors")
    if aliases:
        state.notes.append(
            f"{len(aliases)} tied names stored once (recorded in the metadata entry {ALIASES_KEY!r}; "
            f"flatshard.checkpoint.load_safetensors restores them): {_some(f'{a} -> {s}' for a, s in aliases.items())}"
        )
    metadata = {
        "format": "pt",  # what Hugging Face's loaders expect of a PyTorch file
        ALIASES_KEY: json.dumps(aliases),
        "flatshard.weights": "ema" if ema else "model",
        "flatshard.version": __version__,
    }
    header = encode_header([(e.name, e.dtype, e.shape, e.nbytes) for e in entries], metadata)
    total = sum(e.nbytes for e in entries)

    def write(f: IO[bytes]) -> None:
        f.write(header)
        with Progress(total, progress and total >= PROGRESS_MIN_BYTES, os.path.basename(str(out))) as bar:
            for entry, tensor in read_tensors(entries, state.reader):
                _write_tensor(f, entry, tensor, bar)
                if state.pages is not None:  # the pages just read from a mapped file go back
                    state.pages.release(tensor)

    path = write_offline(target, write)
    return ExportResult(path, len(entries), total, aliases, tuple(state.notes))


def load_safetensors(path: str | os.PathLike[str] | Remote, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file into a state dict, the tied names of an export restored.

    Every name that :func:`export_safetensors` stored once is back, as the same tensor object as its stored
    name (so ``load_state_dict(strict=True)`` sees every key). Needs the safetensors package.

    Args:
        path: the file, a local path or an fsspec URL.
        device: where the tensors go (default ``"cpu"``).
    """
    try:
        import safetensors.torch
    except ImportError as err:
        raise ImportError(f"load_safetensors needs the safetensors package. HINT: {_PIP_HINT}") from err
    location = locate(path)
    try:
        if isinstance(location, Path):
            if not location.is_file():
                raise FileNotFoundError(f"{location} does not exist or is not a file. HINT: check the path.")
            tensors = safetensors.torch.load_file(location, device=device)
            with safetensors.safe_open(location, framework="pt") as f:
                metadata = f.metadata() or {}
        else:
            data = location.fs.cat_file(location.path)
            tensors = {k: v.to(device) for k, v in safetensors.torch.load(data).items()}
            (length,) = struct.unpack("<Q", data[:8])
            metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    except (FileNotFoundError, ImportError):
        raise
    except Exception as err:
        raise CheckpointError(
            f"{location} could not be read as a safetensors file ({type(err).__name__}: {err}). HINT: check that "
            "the file is complete; export it again."
        ) from err
    for name, stored in json.loads(metadata.get(ALIASES_KEY) or "{}").items():
        if stored not in tensors:
            raise CheckpointError(
                f"{location}: the tied name {name!r} refers to {stored!r}, which it does not hold."
            )
        tensors[name] = tensors[stored]
    return tensors


# ---------------------------------------------------------------------------------------------- sources
def open_state(src: str | os.PathLike[str] | Remote) -> _State:
    """A checkpoint's model state (a full file or a sharded directory), nothing large read yet."""
    location = locate(src)
    if is_sharded_checkpoint(location) or (isinstance(location, Path) and location.is_dir()):
        return _sharded_state(ShardedReader(location))
    checkpoint = load_checkpoint_file(location)
    model = checkpoint.get("state_dict")
    if not isinstance(model, Mapping):
        raise CheckpointError(
            f"Checkpoint {location} has no 'state_dict' entry (it holds {sorted(map(str, checkpoint))[:10]}): not "
            "a Lightning or flatshard checkpoint. HINT: pass a checkpoint written by Trainer.save_checkpoint or "
            "flatshard.save_checkpoint."
        )
    values = {
        k: v if isinstance(v, torch.Tensor) else _NotTensor(f"a {type(v).__name__}") for k, v in model.items()
    }
    pages = MappedPages(location) if isinstance(location, Path) else None
    return _State(str(location), values, _tensor_ties(values), checkpoint, None, [], pages)


def _sharded_state(reader: ShardedReader) -> _State:
    layout = reader.layout()
    if not layout.model:
        raise CheckpointError(
            f"Checkpoint {reader.path} holds no model state ('state_dict'). HINT: pass a checkpoint written by "
            "Trainer.save_checkpoint or flatshard.save_checkpoint, or by Lightning's FSDP strategies."
        )
    values: dict[str, Any] = {}
    for key, fqn in layout.model.items():
        md = reader.tensor_meta(fqn)
        if md is not None:
            values[key] = _Stored(fqn, md.properties.dtype, reader.full_shape(fqn), reader.is_piece(fqn))
        elif reader.is_object(fqn):
            values[key] = _NotTensor("an object")
        else:
            raise CheckpointError(
                f"Sharded checkpoint {reader.path} lists {key!r} but holds no entry {fqn!r}. HINT: the directory "
                "is damaged; use an earlier checkpoint."
            )
    extra = reader.with_whole_pieces(reader.read_extra(layout))
    return _State(str(reader.path), values, dict(layout.aliases), extra, reader, [])


def _tensor_ties(values: Mapping[str, Any]) -> dict[str, str]:
    """``{key: earlier key}`` for tensors that are the same view of the same storage."""
    first: dict[tuple[Any, ...], str] = {}
    ties: dict[str, str] = {}
    for key, t in values.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
            continue
        identity = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            t.dtype,
            t.shape,
            t.stride(),
        )
        if identity in first:
            ties[key] = first[identity]
        else:
            first[identity] = key
    return ties


def _groups(keys: Sequence[str], ties: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Each key's group leader: the first key (in ``keys`` order) of the tensor it is tied to, given pairs
    of tied keys."""
    index = {k: i for i, k in enumerate(keys)}
    parent = {k: k for k in keys}

    def find(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for a, b in ties:
        if a in parent and b in parent:
            ra, rb = sorted((find(a), find(b)), key=index.__getitem__)
            parent[rb] = ra  # the earlier leader stays the leader
    return {k: find(k) for k in keys}


def with_ema(state: _State, key: str | None) -> _State:
    """``state`` with the EMA weights in place of the trained ones (see [Note: safetensors export])."""
    callbacks = state.extra.get("callbacks")
    found = {
        k: v
        for k, v in (callbacks.items() if isinstance(callbacks, Mapping) else ())
        if isinstance(k, str) and k.startswith(EMA_KEY_PREFIX) and isinstance(v, Mapping) and EMA_ENTRY in v
    }
    if not found:
        raise CheckpointError(
            f"Checkpoint {state.path}: this checkpoint holds no EMA weights; train with "
            f"flatshard.lightning.ShardedEMA (EMA weights are read from checkpoint['callbacks'][<a key starting "
            f"with {EMA_KEY_PREFIX!r}>][{EMA_ENTRY!r}]). HINT: export the trained weights without --ema."
        )
    if key is None and len(found) > 1:
        raise CheckpointError(
            f"Checkpoint {state.path} holds several EMA states: {sorted(found)}. HINT: pick one with --ema-key KEY "
            "(ema=KEY in Python)."
        )
    if key is not None and key not in found:
        raise CheckpointError(
            f"Checkpoint {state.path} holds no EMA state under {key!r}; it holds {sorted(found)}. HINT: pass one of "
            "those keys."
        )
    weights = found[key if key is not None else next(iter(found))][EMA_ENTRY]
    if not isinstance(weights, Mapping):
        raise CheckpointError(
            f"Checkpoint {state.path}: the EMA state's {EMA_ENTRY!r} is a {type(weights).__name__}, not a mapping "
            "of parameter names to tensors."
        )
    unknown = [k for k in weights if k not in state.values]
    if unknown:
        raise CheckpointError(
            f"Checkpoint {state.path}: the EMA state names {len(unknown)} weights the model state does not have "
            f"({unknown[:5]}; the model's names look like {list(state.values)[:3]}). HINT: the EMA state must be "
            "keyed by the model's state-dict names."
        )
    for k, value in weights.items():
        model_value = state.values[k]
        if isinstance(value, torch.Tensor) and not isinstance(model_value, _NotTensor):
            if value.shape != model_value.shape:
                raise CheckpointError(
                    f"Checkpoint {state.path}: the EMA weight {k!r} has shape {tuple(value.shape)}, the model's "
                    f"{tuple(model_value.shape)}. HINT: the EMA state must hold full tensors (consolidated), keyed "
                    "by the model's state-dict names."
                )
    keys = list(state.values)
    leaders = _groups(keys, [*state.ties.items(), *_tensor_ties(weights).items()])
    chosen: dict[str, Any] = {}  # group leader -> the group's EMA value, the checkpoint's if none
    for k in keys:
        if k in weights and leaders[k] not in chosen:
            value = weights[k]
            chosen[leaders[k]] = (
                value if isinstance(value, torch.Tensor) else _NotTensor(f"a {type(value).__name__}")
            )
    kept = [k for k in keys if leaders[k] not in chosen]
    values = {k: chosen.get(leaders[k], state.values[leaders[k]]) for k in keys}
    notes = list(state.notes)
    if kept:
        notes.append(
            f"{len(kept)} entries are not in the EMA state and keep the checkpoint's values (buffers, parameters "
            f"the EMA does not average): "
            f"{_some(kept)}"
        )
    ties = {k: leader for k, leader in leaders.items() if leader != k}
    return _State(state.path, values, ties, state.extra, state.reader, notes, state.pages)


def open_entries(
    src: str | os.PathLike[str] | Remote, prefix: str, ema: bool | str, caller: str
) -> tuple[_State, list[_Entry], dict[str, str]]:
    """What every safetensors export reads first: the state of ``src`` (its EMA weights with ``ema``, a key or
    ``True``), the entries to write and ``{tied name: stored name}`` (see :func:`select_entries`)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch platform in use
        raise CheckpointError(f"{caller} needs a little-endian machine (safetensors data is little-endian).")
    state = open_state(src)
    if ema:
        state = with_ema(state, ema if isinstance(ema, str) else None)
    entries, aliases = select_entries(state, prefix)
    return state, entries, aliases


def select_entries(state: _State, prefix: str) -> tuple[list[_Entry], dict[str, str]]:
    """The entries to write (the prefix applied, each tied tensor once) and ``{tied name: stored name}``."""
    keys = [k for k in state.values if k.startswith(prefix)]
    if not keys:
        raise CheckpointError(
            f"Checkpoint {state.path}: no state-dict name starts with the prefix {prefix!r}. The prefixes present: "
            f"{_prefixes(state.values)}. HINT: pass one of them (with its trailing '.') or no prefix."
        )
    names = {k: k[len(prefix) :] for k in keys}
    bad = [k for k, name in names.items() if not name or name.startswith(".")]
    if bad:
        raise CheckpointError(
            f"Checkpoint {state.path}: the prefix {prefix!r} leaves names that are empty or start with '.' "
            f"({bad[:3]}). HINT: end the prefix with '.', e.g. {prefix.rstrip('.') + '.'!r}."
        )
    leaders = _groups(list(state.values), state.ties.items())
    stored_as: dict[str, str] = {}  # group leader -> the selected key it is written under
    entries: list[_Entry] = []
    aliases: dict[str, str] = {}
    for key in keys:
        leader = leaders[key]
        if leader in stored_as:
            aliases[names[key]] = names[stored_as[leader]]
            continue
        stored_as[leader] = key
        value = state.values[leader]
        if isinstance(value, _NotTensor):
            state.notes.append(
                f"left out {key!r}: {value.what}, not a tensor (safetensors holds tensors only)"
            )
            continue
        entries.append(_entry(state.path, names[key], value))
    return entries, aliases


def _entry(path: str, name: str, value: torch.Tensor | _Stored) -> _Entry:
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        raise CheckpointError(
            f"Checkpoint {path}: {name!r} is a {value.layout} tensor; safetensors stores dense tensors only. HINT: "
            "export to .ckpt instead, or make it dense in the model."
        )
    if value.dtype not in CODES:
        raise CheckpointError(
            f"Checkpoint {path}: {name!r} has dtype {value.dtype}, which safetensors cannot store. HINT: export to "
            ".ckpt instead (flatshard consolidate SRC OUT.ckpt keeps every dtype), or hold it in one of "
            + ", ".join(str(d).replace("torch.", "") for d in CODES)
            + "."
        )
    return _Entry(name, value, value.dtype, torch.Size(value.shape))


def _prefixes(keys: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """The first name component of each key, with its '.' (``model.``, ``head.``), in first-seen order."""
    return list(dict.fromkeys(k.split(".", 1)[0] + ("." if "." in k else "") for k in keys))


def _some(items: Any, n: int = 5) -> str:
    items = list(items)
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------- writing
def read_tensors(
    entries: Sequence[_Entry], reader: ShardedReader | None
) -> Iterator[tuple[_Entry, torch.Tensor]]:
    """Each entry with its tensor, in order; stored tensors read in batches of about ``_BATCH_BYTES``."""
    pending: list[_Entry] = []
    size = 0
    for i, entry in enumerate(entries):
        if isinstance(entry.value, _Stored):
            pending.append(entry)
            size += entry.nbytes
        else:
            yield entry, entry.value
        last = i == len(entries) - 1
        if pending and (size >= _BATCH_BYTES or last or not isinstance(entries[i + 1].value, _Stored)):
            assert reader is not None  # only a sharded directory has stored entries
            yield from zip(pending, _read(reader, [e.value for e in pending if isinstance(e.value, _Stored)]))
            pending, size = [], 0


def _read(reader: ShardedReader, stored: Sequence[_Stored]) -> list[torch.Tensor]:
    targets: dict[str, Any] = {}
    for s in stored:
        md = reader.tensor_meta(s.fqn)
        assert md is not None
        flat = torch.empty(md.size, dtype=md.properties.dtype)
        targets[s.fqn] = ParamShard(flat, 0, s.shape) if s.piece else flat
    reader.read(targets)
    return [t.local.view(t.shape) if isinstance(t, ParamShard) else t for t in targets.values()]


def _write_tensor(f: IO[bytes], entry: _Entry, tensor: torch.Tensor, bar: Progress) -> None:
    if tensor.dtype != entry.dtype or tensor.shape != entry.shape:  # a damaged directory
        raise CheckpointError(
            f"{entry.name!r} was read as {tensor.dtype} {tuple(tensor.shape)}, expected "
            f"{entry.dtype} {tuple(entry.shape)}. HINT: use an earlier checkpoint."
        )
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, data.numel(), _CHUNK_BYTES):
        chunk = data[start : start + _CHUNK_BYTES]
        f.write(chunk.numpy().data)
        bar.update(chunk.numel())


class Progress:
    """A byte-count progress bar on stderr (tqdm, which Lightning depends on), or nothing when disabled."""

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=label,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=True,
            )

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
