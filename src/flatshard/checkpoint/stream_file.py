"""Writing a ``torch.save`` file tensor by tensor, as the tensors become available.

[Note: a torch.save file written as it streams]
``torch.save`` writes a zip archive (stored, not compressed) of records: ``data.pkl``, the pickled object in
which every tensor is what the tensor's own ``__reduce_ex__`` returns (a rebuild function such as
``_rebuild_tensor_v2`` or, for newer dtypes, ``_rebuild_tensor_v3``) with its storage pickled as a *persistent
id* ``("storage", <storage type>, key, location, numel)``; one record ``data/<key>`` per storage with its raw
bytes, aligned so that ``torch.load(mmap=True)`` maps them in place; and a few small records
(``.format_version``, ``.storage_alignment``, ``byteorder``). A reader finds records through the zip's central
directory, written last, so their order in the file is free: ``torch.save`` writes ``data.pkl`` first because it
holds the whole object in memory anyway.

:class:`StreamedTorchFile` writes the same archive the other way round: each tensor's bytes go into their
record as soon as the tensor is known (:meth:`~StreamedTorchFile.tensor` returns a small stand-in that pickles
exactly as that tensor would), the caller drops the tensor, and :meth:`~StreamedTorchFile.finish` pickles the
object, stand-ins and all, into ``data.pkl`` and closes the archive. So a full checkpoint of a sharded model
is written while it is gathered, one unit at a time, with memory for a unit instead of for the model; the
file is the one ``torch.save`` would write for the same object (same records, same pickle apart from storage
keys), read by ``torch.load`` (``weights_only=True`` and ``mmap=True`` included) without flatshard. Tensors
left in the object as real tensors (buffers, step counters, small states) are stored by the pickler when
``finish`` runs, as ``torch.save`` stores them. The records go through torch's own writer (the one
``torch.save`` uses), to a path or to any object with ``write``.

[Note: every dtype torch.save writes]
No table of dtypes lives here: how a tensor pickles is asked of the tensor (its public ``__reduce_ex__``, which
picks the rebuild function and wraps its bytes in a ``TypedStorage`` or, for the dtypes without a legacy storage
class such as float8, uint16-64 and complex32, an ``UntypedStorage``), and a storage's persistent id is built
from the storage's public methods, as ``torch.save`` builds it. So whatever ``torch.save`` can write, this file
writes the same way. What it cannot (``torch.uint1``-``uint7``, ``int1``-``int7`` today) is found before the
file is finished: the first tensor of each dtype is checked by a probe (a small tensor of that dtype written
through this writer and read back with ``torch.load(weights_only=True)``, bit for bit, once per process), and
:meth:`~StreamedTorchFile.finish` refuses with a :class:`~flatshard.checkpoint.errors.CheckpointError` naming
the tensor and its dtype before ``data.pkl`` is written, so an unreadable file is never reported written.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import torch
import torch.serialization as serialization

from flatshard.checkpoint.errors import CheckpointError

__all__ = [
    "StreamedTorchFile",
    "TensorRecord",
    "dtype_sample",
    "refuse",
    "tensor_bits",
    "unreadable_dtype",
    "unreadable_tensors",
]

_STORAGES = (torch.TypedStorage, torch.UntypedStorage)

_HINT_TORCH = (
    "HINT: torch.save cannot store this dtype either; keep such values in a dtype it stores (packed sub-byte "
    "values in a torch.uint8 tensor), or leave the tensor out of the checkpoint."
)


class _StorageRecord:
    """A storage already written as record ``data/<key>``: pickled as its persistent id."""

    __slots__ = ("key", "persistent_id")

    def __init__(self, key: str, persistent_id: tuple[Any, ...]) -> None:
        self.key, self.persistent_id = key, persistent_id


class TensorRecord:
    """Stands for a tensor whose bytes are in the file already; pickles as ``torch.save`` pickles the tensor.

    A tensor that cannot be stored (see [Note: every dtype torch.save writes]) gets a record with ``problem``
    set and nothing written; :meth:`StreamedTorchFile.finish` refuses an object holding one.
    """

    __slots__ = ("_reduced", "_tensor", "dtype", "problem", "shape")

    def __init__(
        self,
        dtype: torch.dtype,
        shape: torch.Size,
        reduced: tuple[Any, ...] | None = None,
        tensor: torch.Tensor | None = None,
        problem: str | None = None,
    ) -> None:
        self.dtype, self.shape, self.problem = dtype, shape, problem
        self._reduced = reduced  # the tensor's reduction, its storages replaced by written records
        self._tensor = tensor  # or the tensor itself, reduced when pickled (a subclass, a sparse tensor)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._reduced is not None:
            return self._reduced
        if self._tensor is not None:
            return self._tensor.__reduce_ex__(protocol)
        # finish() names the tensor and refuses first; this is for one inside an object it does not walk
        raise CheckpointError(_refusal("a tensor", self.dtype, self.problem or "it was not written"))

    def __repr__(self) -> str:
        return f"TensorRecord({self.dtype}, {tuple(self.shape)})"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's "TypedStorage is deprecated" warning: the storages asked here are the ones a tensor's own
    ``__reduce_ex__`` hands to the pickler, asked as ``torch.save`` asks them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


def _storage_identity(storage: Any) -> tuple[torch.UntypedStorage, Any, int]:
    """``(bytes, storage type, numel)`` of a storage a tensor pickles with, as ``torch.save`` derives them."""
    with _quiet():
        if isinstance(storage, torch.TypedStorage):
            return storage.untyped(), getattr(torch, storage.pickle_storage_type()), storage.size()
        return storage, torch.UntypedStorage, storage.nbytes()


def _refusal(name: str, dtype: torch.dtype, problem: str, into: str = "a torch.save file") -> str:
    return f"Cannot write {name} (a {dtype} tensor) into {into}: {problem}"


class StreamedTorchFile:
    """A ``torch.save`` archive written record by record (see [Note: a torch.save file written as it streams]).

    Args:
        f: a path or a binary file object (anything with ``write``).
    """

    _checked = True  # see [Note: every dtype torch.save writes]; off for the probe's own file

    def __init__(self, f: str | IO[bytes]) -> None:
        self._opener = serialization._open_zipfile_writer(f)
        self._zip = self._opener.__enter__()  # torch.save's own record writer
        self._keys = 0
        self._closed = False
        self.bytes_written = 0

    def _next_key(self) -> str:
        key = str(self._keys)
        self._keys += 1
        return key

    def _write(self, storage: torch.UntypedStorage) -> str:
        key = self._next_key()
        nbytes = storage.nbytes()
        if storage.device.type != "cpu":
            storage = storage.cpu()
        self._zip.write_record(f"data/{key}", storage, nbytes)
        self.bytes_written += nbytes
        return key

    def _problem(self, dtype: torch.dtype) -> str | None:
        return unreadable_dtype(dtype) if self._checked else None

    def tensor(self, t: torch.Tensor) -> TensorRecord:
        """Write ``t``'s elements now; the returned stand-in goes where ``t`` would in the saved object."""
        if self._closed:
            raise RuntimeError("StreamedTorchFile.tensor() after finish().")
        data = t.detach()
        problem = self._problem(data.dtype)
        if problem is not None:
            return TensorRecord(data.dtype, data.shape, problem=problem)  # finish() names it and refuses
        if type(data) is not torch.Tensor or data.layout != torch.strided or data.is_quantized:
            # a subclass, a sparse or a quantized tensor (whose elements may share bytes, and which torch
            # cannot copy for every dtype): pickled by finish() through its own reduction, as torch.save does
            return TensorRecord(data.dtype, data.shape, tensor=data)
        data = data.resolve_conj().resolve_neg().cpu()
        if (
            not data.is_contiguous()
            or data.storage_offset() != 0
            or data.untyped_storage().nbytes() != data.numel() * data.element_size()
        ):
            data = data.contiguous().clone()  # the record holds exactly the tensor's elements
        rebuild, args = data.__reduce_ex__(2)[:2]
        written = False
        parts = list(args)
        for i, part in enumerate(parts):
            if isinstance(part, _STORAGES):
                untyped, storage_type, numel = _storage_identity(part)
                key = self._write(untyped)
                parts[i] = _StorageRecord(key, ("storage", storage_type, key, "cpu", numel))
                written = True
        if not written:  # a reduction holding no storage of its own: pickled whole by finish()
            return TensorRecord(data.dtype, data.shape, tensor=data)
        return TensorRecord(data.dtype, data.shape, reduced=(rebuild, tuple(parts)))

    def finish(self, obj: Any) -> None:
        """Pickle ``obj`` (holding stand-ins from :meth:`tensor` and any other picklable values) as ``data.pkl``
        and close the archive.

        Raises:
            CheckpointError: a tensor in ``obj`` has a dtype that ``torch.load`` could not read back (see
                [Note: every dtype torch.save writes]); ``data.pkl`` is not written.
        """
        if self._checked:
            self._refuse_unreadable(obj)
        seen: dict[tuple[Any, ...], str] = {}
        writer = self

        class _Pickler(pickle.Pickler):
            def persistent_id(self, value: Any) -> Any:
                if isinstance(value, _StorageRecord):
                    return value.persistent_id
                if isinstance(value, _STORAGES):  # a real tensor left in the object, reduced by itself
                    if isinstance(value, torch.TypedStorage):
                        problem = writer._problem(value.dtype)
                        if problem is not None:  # in an object finish() does not walk
                            raise CheckpointError(_refusal("a tensor", value.dtype, problem))
                    untyped, storage_type, numel = _storage_identity(value)
                    identity = (untyped.device, untyped.data_ptr(), untyped.nbytes(), storage_type)
                    key = seen.get(identity) if untyped.data_ptr() else None  # one record per storage
                    if key is None:
                        key = writer._write(untyped)
                        if untyped.data_ptr():
                            seen[identity] = key
                    return ("storage", storage_type, key, serialization.location_tag(untyped), numel)
                return None

        buffer = io.BytesIO()
        with _quiet():
            _Pickler(buffer, protocol=2).dump(obj)
        data = buffer.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", 1)
        alignment = getattr(serialization, "_get_storage_alignment", None)
        if alignment is not None:
            text = str(alignment())
            self._zip.write_record(".storage_alignment", text, len(text))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self.close()

    def _refuse_unreadable(self, obj: Any) -> None:
        """Raise naming every tensor of ``obj`` (in its dicts, lists and tuples) that cannot be read back."""
        refuse(unreadable_tensors(obj), "a torch.save file")

    def close(self) -> None:
        """Close the archive (``finish`` does); a file closed without ``finish`` has no ``data.pkl``."""
        if not self._closed:
            self._closed = True
            self._opener.__exit__(None, None, None)


def _tensors_in(obj: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` for each tensor and stand-in in ``obj``'s dicts, lists and tuples."""
    if isinstance(obj, (torch.Tensor, TensorRecord)):
        yield where, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors_in(v, f"{where}[{k!r}]" if where else k if isinstance(k, str) else repr(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors_in(v, f"{where}[{i}]")


def unreadable_tensors(
    obj: Any, problem: Callable[[torch.dtype], str | None] | None = None
) -> list[tuple[str, torch.dtype, str]]:
    """``(path, dtype, why)`` for each tensor in ``obj``'s dicts, lists and tuples (and each stand-in of
    :meth:`StreamedTorchFile.tensor`) that would not read back: ``problem(dtype)`` says why, by default
    :func:`unreadable_dtype`. Paths read like ``state_dict['layer.weight']``."""
    check = unreadable_dtype if problem is None else problem
    found = []
    for where, value in _tensors_in(obj):
        why = value.problem if isinstance(value, TensorRecord) else check(value.dtype)
        if why is not None:
            found.append((where or "the object", value.dtype, why))
    return found


def refuse(found: Sequence[tuple[str, torch.dtype, str]], into: str) -> None:
    """Raise a :class:`CheckpointError` for what :func:`unreadable_tensors` found (nothing if it found nothing):
    the first tensor with its dtype and reason (which ends in a hint), and the names of up to five others."""
    if not found:
        return
    where, dtype, why = found[0]
    more = f" The same holds for {len(found) - 1} more: {', '.join(w for w, _, _ in found[1:6])}."
    raise CheckpointError(_refusal(where, dtype, why, into) + (more if len(found) > 1 else ""))


class _Unchecked(StreamedTorchFile):
    _checked = False


def dtype_sample(dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of ``dtype`` holding varied bits (valid values: a bool is 0 or 1)."""
    with contextlib.suppress(RuntimeError, TypeError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.linspace(-2.0, 2.0, 8), 0.25, 3, dtype)  # quantized dtypes
    if dtype == torch.bool:
        return torch.arange(32) % 3 == 0
    return torch.arange(1, 33, dtype=torch.uint8).view(dtype)


def tensor_bits(t: torch.Tensor) -> bytes:
    """``t``'s elements as bytes, row-major (a quantized tensor's integers and scale)."""
    if t.is_quantized:
        return bytes(t.int_repr().reshape(-1).view(torch.uint8).numpy()) + repr(t.q_scale()).encode()
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


@functools.cache
def unreadable_dtype(dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` written by :class:`StreamedTorchFile` would not read back, ``None`` where it
    does: the probe of [Note: every dtype torch.save writes], run once per dtype and process."""
    try:
        sample = dtype_sample(dtype)
    except (RuntimeError, TypeError) as err:
        return f"torch cannot make a tensor of it ({str(err).splitlines()[0]}). {_HINT_TORCH}"
    problem = _probe(sample)
    if problem is None:
        return None
    if _probe(sample, torch_save=True) is not None:
        return f"{problem}. {_HINT_TORCH}"
    return (
        f"{problem}, while torch.save stores it. HINT: save this checkpoint with state_dict_type='sharded' "
        "(a torch.distributed.checkpoint directory) until flatshard's streamed writer stores the dtype."
    )


def _probe(sample: torch.Tensor, torch_save: bool = False) -> str | None:
    """Why ``sample`` does not come back bit for bit through this writer (through ``torch.save`` itself with
    ``torch_save``) and ``torch.load(weights_only=True)``; ``None`` where it does."""
    dtype = sample.dtype
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized dtypes are deprecated; ComplexHalf is experimental
            if torch_save:
                torch.save({"streamed": sample, "whole": sample}, buffer)
            else:
                writer = _Unchecked(buffer)
                try:
                    writer.finish({"streamed": writer.tensor(sample), "whole": sample})
                finally:
                    writer.close()
            back = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as err:
        return f"writing or reading it back fails ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    for how in ("streamed", "whole"):
        got = back[how]
        if not isinstance(got, torch.Tensor) or got.dtype != dtype or tensor_bits(got) != tensor_bits(sample):
            return f"torch.load reads it back as {getattr(got, 'dtype', type(got))} with other bits"
    return None
