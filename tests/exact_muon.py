"""Newton-Schulz iterations in float32 for the parity tests of torch's Muon.

torch's Muon orthogonalises each update by Newton-Schulz iterations in bfloat16. Under sharding the gradients
are summed in another order than on one process (differences of 1e-8), and bfloat16 rounding can turn that into
differences of 1e-4 in the weights, depending on the torch release. Tests that compare Muon under flatshard with
the unsharded model or DDP to 1e-5 call :func:`use_float32_newton_schulz` at import (so spawned ranks do too):
the same quintic iteration, in float32. The optimizer's own bfloat16 path is tested with a tolerance that allows
for it (``test_stock_muon_within_bfloat16_rounding``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

_ORIGINAL: Any = None


def _float32_newton_schulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def use_float32_newton_schulz(on: bool = True) -> None:
    """Patch (or, with ``on=False``, restore) torch's Muon iteration in this process; a no-op without Muon."""
    global _ORIGINAL
    try:
        module = importlib.import_module("torch.optim._muon")
    except ImportError:
        return
    if not hasattr(module, "_zeropower_via_newtonschulz"):
        return
    if _ORIGINAL is None:
        _ORIGINAL = module._zeropower_via_newtonschulz
    module._zeropower_via_newtonschulz = _float32_newton_schulz if on else _ORIGINAL
