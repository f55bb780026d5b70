"""Writing a ``torch.save`` file tensor by tensor, as the tensors become available.

[Note: a torch.save file written as it streams]
``torch.save`` writes a zip archive (stored, not compressed) of records: ``data.pkl``, the pickled object in
which every tensor is a call to ``torch._utils._rebuild_tensor_v2`` on a *persistent id*
``("storage", <dtype>Storage, key, location, numel)``; one record ``data/<key>`` per storage with its raw bytes,
aligned so that ``torch.load(mmap=True)`` maps them in place; and a few small records (``.format_version``,
``.storage_alignment``, ``byteorder``). A reader finds records through the zip's central directory, written
last, so their order in the file is free: ``torch.save`` writes ``data.pkl`` first because it holds the whole
object in memory anyway.

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
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from typing import IO, Any

import torch
import torch.serialization as serialization

__all__ = ["StreamedTorchFile", "TensorRecord"]


class _StorageRecord:
    """A storage already written as record ``data/<key>``: pickled as its persistent id."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorRecord:
    """Stands for a tensor whose bytes are in the file already; pickles as ``torch.save`` pickles the tensor."""

    __slots__ = ("shape", "storage")

    def __init__(self, storage: _StorageRecord, shape: torch.Size) -> None:
        self.storage, self.shape = storage, shape

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= max(int(n), 1)
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()),
        )

    def __repr__(self) -> str:
        return f"TensorRecord(data/{self.storage.key}, {self.storage.dtype}, {tuple(self.shape)})"


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class StreamedTorchFile:
    """A ``torch.save`` archive written record by record (see [Note: a torch.save file written as it streams]).

    Args:
        f: a path or a binary file object (anything with ``write``).
    """

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

    def _write_storage(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> _StorageRecord:
        key = self._next_key()
        nbytes = storage.nbytes()
        if storage.device.type != "cpu":
            storage = storage.cpu()
        self._zip.write_record(f"data/{key}", storage, nbytes)
        self.bytes_written += nbytes
        return _StorageRecord(key, dtype, nbytes // dtype.itemsize)

    def tensor(self, t: torch.Tensor) -> TensorRecord:
        """Write ``t``'s elements now; the returned stand-in goes where ``t`` would in the saved object."""
        if self._closed:
            raise RuntimeError("StreamedTorchFile.tensor() after finish().")
        data = t.detach()
        if (
            not data.is_contiguous()
            or data.storage_offset() != 0
            or data.untyped_storage().nbytes() != data.numel() * data.element_size()
        ):
            data = data.contiguous().clone()  # the record holds exactly the tensor's elements
        return TensorRecord(self._write_storage(data.untyped_storage(), data.dtype), data.shape)

    def finish(self, obj: Any) -> None:
        """Pickle ``obj`` (holding stand-ins from :meth:`tensor` and any other picklable values) as ``data.pkl``
        and close the archive."""
        seen: dict[int, str] = {}
        writer = self

        class _Pickler(pickle.Pickler):
            def persistent_id(self, value: Any) -> Any:
                if isinstance(value, _StorageRecord):
                    return ("storage", _storage_type(value.dtype), value.key, "cpu", value.numel)
                if isinstance(value, torch.storage.TypedStorage):  # a real tensor left in the object
                    storage = value._untyped_storage
                    key = seen.get(storage._cdata)
                    if key is None:
                        key = seen[storage._cdata] = writer._write_storage(storage, value.dtype).key
                    location = serialization.location_tag(storage)
                    return (
                        "storage",
                        getattr(torch, value._pickle_storage_type()),
                        key,
                        location,
                        value._size(),
                    )
                return None

        buffer = io.BytesIO()
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

    def close(self) -> None:
        """Close the archive (``finish`` does); a file closed without ``finish`` has no ``data.pkl``."""
        if not self._closed:
            self._closed = True
            self._opener.__exit__(None, None, None)
