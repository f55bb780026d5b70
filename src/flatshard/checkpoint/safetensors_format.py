"""The ``.safetensors`` format: dtype codes, the header's parse and its encoding. No file access here.

[Note: safetensors format]
A ``.safetensors`` file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (each tensor's
``dtype`` code, ``shape`` and ``data_offsets`` ``[begin, end)`` relative to the end of the header, plus an
optional ``__metadata__`` map of strings), then the tensors' bytes back to back, row-major, little-endian.
A contiguous range of a tensor's flattened elements is therefore one contiguous byte range of the file:
what lets each rank read only the pieces it keeps. ``F4`` (two float4 values per byte) is stored with the
logical shape, its last dimension twice torch's ``float4_e2m1fn_x2`` one.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "CODES",
    "DTYPES",
    "HEADER_LIMIT",
    "HeaderEntry",
    "element_size",
    "encode_header",
    "parse_header",
    "storage_shape",
]

HEADER_LIMIT = 100 * 2**20  # the safetensors package refuses larger headers; a larger one is damage

# safetensors dtype code -> torch dtype (the codes of the safetensors specification)
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "F8_E8M0": torch.float8_e8m0fnu,
        "F4": torch.float4_e2m1fn_x2,
        "C64": torch.complex64,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)
CODES: Mapping[torch.dtype, str] = MappingProxyType({dtype: code for code, dtype in DTYPES.items()})


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a file: its torch dtype, torch shape and absolute byte range in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # torch's shape (F4: the last dimension halved)
    begin: int  # absolute offset of the first byte in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def storage_shape(dtype: torch.dtype, shape: Sequence[int]) -> list[int]:
    """The shape written in the header for a torch tensor of ``dtype`` and ``shape``."""
    if dtype == torch.float4_e2m1fn_x2 and shape:
        return [*shape[:-1], shape[-1] * 2]
    return list(shape)


def _torch_shape(code: str, shape: list[int]) -> tuple[int, ...]:
    if code == "F4" and shape:
        if shape[-1] % 2:
            raise ValueError(f"an F4 tensor's last dimension must be even, got {shape}")
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def parse_header(
    raw: bytes, file_size: int | None, where: str
) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """The entries and the ``__metadata__`` of a file whose first bytes are ``raw`` (the 8-byte length and at
    least the JSON header); ``file_size`` (when known) is checked against the last tensor's end.

    Raises ``ValueError`` naming ``where`` and what is wrong: a short or oversized header, JSON that does not
    parse, an unknown dtype code, a byte range that does not match the shape, or data past the file's end
    (a truncated file).
    """
    if len(raw) < 8:
        raise ValueError(f"{where}: {len(raw)} bytes, too short for a safetensors header (a truncated file?)")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > HEADER_LIMIT:
        raise ValueError(f"{where}: a header length of {length} bytes is not a safetensors file's")
    if len(raw) < 8 + length:
        raise ValueError(
            f"{where}: the header needs {length} bytes, only {len(raw) - 8} are there (truncated)"
        )
    try:
        header = json.loads(raw[8 : 8 + length])
    except ValueError as err:
        raise ValueError(f"{where}: the header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: tensor {name!r} has a malformed header entry {info!r}") from err
        if code not in DTYPES:
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {code!r}, which this reader does not know "
                f"(known: {', '.join(DTYPES)})"
            )
        dtype = DTYPES[code]
        torch_shape = _torch_shape(code, shape)
        numel = 1
        for d in torch_shape:
            numel *= d
        if end - begin != numel * element_size(dtype) or begin < 0:
            raise ValueError(
                f"{where}: tensor {name!r} ({code} {shape}) claims bytes [{begin}, {end}), "
                f"{numel * element_size(dtype)} expected"
            )
        entries[name] = HeaderEntry(name, dtype, torch_shape, base + begin, base + end)
    if file_size is not None:
        last = max((e.end for e in entries.values()), default=base)
        if last > file_size:
            culprit = max(entries.values(), key=lambda e: e.end).name if entries else "the header"
            raise ValueError(
                f"{where}: {file_size} bytes, but {culprit!r} ends at byte {last} (a truncated file?)"
            )
    return entries, {str(k): str(v) for k, v in metadata.items()}


def encode_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """The length prefix and JSON header for ``(name, dtype, torch shape, nbytes)`` stored back to back in
    that order, padded with spaces to a multiple of 8 bytes (as the safetensors package pads it)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        if dtype not in CODES:
            raise ValueError(f"{name!r} has dtype {dtype}, which safetensors cannot store")
        header[name] = {
            "dtype": CODES[dtype],
            "shape": storage_shape(dtype, shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
