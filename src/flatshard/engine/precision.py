"""Mixed precision: per-unit dtypes, input casts, buffer casts and full-precision batch norm.

[Note: mixed precision]
The sharded flat parameter (the optimizer's master weights, and what checkpoints hold) keeps the
parameters' own dtype. A unit whose ``param_dtype`` differs casts its shard to ``param_dtype`` and
all-gathers that copy, so gathers and compute move half the bytes; the gradient is computed in
``param_dtype``, reduced in ``reduce_dtype`` and accumulated into a gradient shard of the parameter's
dtype (``keep_low_precision_grads`` keeps it in ``reduce_dtype``). The dtype rule: an unset
``reduce_dtype`` follows ``param_dtype``; precision is "mixed" when a dtype differs from the
parameter's own (compared, never tested for ``None``).

Floating-point forward inputs of a mixed unit are cast to ``param_dtype`` with ``Tensor.to``, inside
autograd, so inputs that require grad still receive gradients. One exception: a Lightning step routed
through the root's hooks under autocast (``*-mixed`` flags) is not a module forward, and its batch keeps
its dtypes (targets, masks), as under DDP; autocast picks the compute dtypes (``UnitState.cast_inputs``).
Buffers are cast to ``buffer_dtype`` once, at ``shard()``; state dicts return them in their original
dtype. Batch-norm modules run in full precision whenever ``param_dtype`` or ``buffer_dtype`` is set: their
buffers are never cast; under ``param_dtype`` they become units of their own without mixed precision, their
inputs are cast up and their outputs cast back to the dtype that came in. torchmetrics ``Metric`` modules
are never cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

from flatshard.engine.config import MixedPrecision

__all__ = [
    "UnitPrecision",
    "cast_buffers",
    "cast_floating",
    "full_precision_modules",
    "original_buffer_dtypes",
    "reduce_divisors",
]

# On a module whose buffers cast_buffers cast: {buffer name: its dtype before}; the module keeps it, so it goes
# (and is copied) with the module.
BUFFER_DTYPES_ATTR = "_flatshard_buffer_dtypes"


@dataclass(frozen=True)
class UnitPrecision:
    """The dtypes one unit uses, resolved against its parameters' dtype ``param``."""

    param: torch.dtype  # the sharded master weights (and checkpoints)
    compute: torch.dtype  # the gathered flat parameter and its gradient
    reduce: torch.dtype  # gradient communication
    grad: torch.dtype  # the gradient shard the optimizer sees
    cast_forward_inputs: bool

    @classmethod
    def resolve(cls, policy: MixedPrecision | None, param: torch.dtype) -> UnitPrecision:
        if policy is None:
            return cls(param, param, param, param, False)
        compute = policy.param_dtype or param
        reduce = policy.reduce_dtype or compute
        grad = reduce if policy.keep_low_precision_grads else param
        return cls(param, compute, reduce, grad, policy.cast_forward_inputs)

    @property
    def mixed(self) -> bool:
        """Whether the gathered parameters differ in dtype from the shard."""
        return self.compute != self.param


def reduce_divisors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """Divide a summed gradient by ``world`` in two steps: before the reduction and after it.

    In fp32 everything is divided after. In 16-bit dtypes a sum over many ranks may overflow (fp16) or
    lose the small terms, so part of the division, a power of two near ``sqrt(world)``, happens first;
    powers of two divide exactly.
    """
    if world <= 1:
        return 1.0, 1.0
    if torch.finfo(dtype).bits > 16:
        return 1.0, float(world)
    pre = float(2 ** math.ceil(math.log2(world) / 2))
    return pre, world / pre


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in a (nested) structure to ``dtype``; autograd sees the cast."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _is_metric(module: nn.Module) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with lightning
        return False
    return isinstance(module, Metric)


def full_precision_modules(root: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    """Batch-norm modules under ``root`` (they keep full precision under mixed precision)."""
    return [m for m in root.modules() if isinstance(m, _BatchNorm) and m not in ignored]


def keep_full_precision(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module`` in ``dtype``: inputs are cast up, outputs cast back to the dtype that came in."""
    incoming: list[torch.dtype | None] = []

    def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        floats = [t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()]
        incoming.append(floats[0] if floats else None)
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    def post(_: nn.Module, args: Any, output: Any) -> Any:
        came_in = incoming.pop() if incoming else None
        return cast_floating(output, came_in) if came_in is not None else output

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)


def _tensors(*trees: Any) -> Iterable[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    for tree in trees:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                yield leaf


def cast_buffers(root: nn.Module, dtype: torch.dtype | None, skip: set[nn.Module]) -> None:
    """Cast floating-point buffers under ``root`` to ``dtype`` once, remembering their original dtypes."""
    if dtype is None:
        return
    skipped = {sub for m in root.modules() if m in skip or _is_metric(m) for sub in m.modules()}
    for m in root.modules():
        if m in skipped:
            continue
        for name, buf in m._buffers.items():
            if buf is None or not buf.is_floating_point() or buf.dtype == dtype:
                continue
            m.__dict__.setdefault(BUFFER_DTYPES_ATTR, {}).setdefault(name, buf.dtype)
            m._buffers[name] = buf.to(dtype)


def original_buffer_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    """State-dict key -> original dtype, for every buffer :func:`cast_buffers` cast under ``root``."""
    out: dict[str, torch.dtype] = {}
    for prefix, m in root.named_modules(remove_duplicate=False):
        for name, dtype in m.__dict__.get(BUFFER_DTYPES_ATTR, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = dtype
    return out
