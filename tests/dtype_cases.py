"""Every dtype ``torch.save`` stores, each with sample tensors whose bits vary, for the "nothing lost" tests.

The dtypes are found, not listed: every ``torch.dtype`` in the ``torch`` namespace whose sample ``torch.save``
writes and ``torch.load(weights_only=True)`` reads back bit for bit is a case (:data:`SAVED`); the others
(``torch.uint1``-``uint7``, ``int1``-``int7`` today) are :data:`REFUSED`. :data:`EXPECTED` names the dtypes
that must be among the cases, so a torch build that drops one fails loudly instead of testing less.

Samples are random bytes (NaN and infinity patterns included for the floating dtypes, both bytes of a float8
pair, every sign), ``bool`` as 0/1, quantized dtypes quantized from random floats. Compare with :func:`same`:
bit for bit (``torch.equal`` would call NaN unequal to itself, and is not implemented for every dtype).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "CASES",
    "EXPECTED",
    "REFUSED",
    "SAVED",
    "DtypeCase",
    "bits",
    "dtype_name",
    "same",
    "sample",
    "saved_by_torch",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _every_dtype() -> list[torch.dtype]:
    return list(dict.fromkeys(v for v in vars(torch).values() if isinstance(v, torch.dtype)))


_QUANTIZED = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` holding varied bits (seeded)."""
    g = torch.Generator().manual_seed(seed + 7919 * len(dtype_name(dtype)))
    numel = 1
    for d in shape:
        numel *= d
    if dtype_name(dtype) in _QUANTIZED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated: still saved, still tested
            values = torch.randn(shape, generator=g) * 3
            return torch.quantize_per_tensor(values, 0.125, 5 if "u" in dtype_name(dtype) else 0, dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    """``t``'s elements as bytes, row-major (with a quantized tensor's scale and zero point)."""
    t = t.detach().cpu()
    if t.is_quantized:
        return bits(t.int_repr()) + f"{t.q_scale()!r}/{t.q_zero_point()}".encode()
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def same(got: object, want: torch.Tensor, what: str = "") -> None:
    """Assert ``got`` is a tensor of ``want``'s dtype and shape with the same bits."""
    assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert bits(got) == bits(want), f"{what}: the bits differ"


def saved_by_torch(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` writes a sample of ``dtype`` that ``torch.load(weights_only=True)`` reads back."""
    try:
        t = sample(dtype)
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save({"t": t}, buffer)
            back = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["t"]
        same(back, t)
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class DtypeCase:
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    def tensor(self, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> torch.Tensor:
        return sample(self.dtype, shape, seed)


SAVED: list[torch.dtype] = [d for d in _every_dtype() if saved_by_torch(d)]
REFUSED: list[torch.dtype] = [d for d in _every_dtype() if d not in SAVED]
CASES: list[DtypeCase] = [DtypeCase(d) for d in SAVED]

EXPECTED = [
    getattr(torch, name)
    for name in (
        "float64 float32 float16 bfloat16 complex32 complex64 complex128 bool uint8 int8 int16 int32 int64 "
        "uint16 uint32 uint64 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu "
        "float4_e2m1fn_x2 qint8 quint8 qint32 quint4x2 quint2x4 bits8 bits16 bits1x8 bits2x4 bits4x2"
    ).split()
    if hasattr(torch, name)
]
missing = [dtype_name(d) for d in EXPECTED if d not in SAVED]
assert not missing, f"torch.save does not round-trip these dtypes here: {missing}"
del missing
