"""The estimate of a 2-D model: a tensor-parallel plan, its mesh under the fake process group, its collectives.

[Note: estimating tensor parallelism]
With ``tensor_parallel_size=k`` the world of ``N`` ranks is the mesh ``(N/k, k)`` ("data_parallel",
"tensor_parallel"), made by ``init_device_mesh`` over the fake process group (consecutive ranks share a
tensor-parallel group, as launchers place them in one node). The model built on the meta device goes through the
plan, a function ``(model, tp_mesh) -> model`` that calls torch's ``parallelize_module``, and then through
``shard(model, device_mesh=mesh)``, as a training script does (see [Note: tensor parallelism]). So the shards
are those of the local tensors over the ``N/k`` data-parallel ranks, and the engine's counts per group are the
data-parallel bytes.

The tensor-parallel bytes are the collectives DTensor issues (all-gathers, reduce-scatters, all-reduces of
activations and of their gradients). DTensor issues them as torch's functional collectives; a dispatch mode
(:class:`TensorParallelTraffic`) sees each one on this rank and counts, per group and kind, the bytes of its
input, as the engine counts its own (an all-gather: this rank's piece; a reduce-scatter or an all-reduce: the
whole input). The mode lets DTensor run first (it declines DTensor arguments), so it sees the collectives that a
DTensor operator issues inside its dispatch, and the same mode counts a real run's ranks for the checks.

The plan comes from ``tensor_parallel_plan`` (a function, or ``"module.path:function"``); without one, the
target's module may define ``tensor_parallel_plan`` (``flatshard.testing.llama`` does). Without either the
estimate refuses, since no plan fits every model.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, cast

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from flatshard.estimator.target import EstimateError, resolve_factory
from flatshard.estimator.tracker import dtensor_type

__all__ = ["TensorParallelTraffic", "apply_plan", "make_mesh", "resolve_plan"]

Plan = Callable[[nn.Module, Any], Any]

# functional collectives (``torch.ops._c10d_functional``) -> the kind the engine counts them as
_KINDS = MappingProxyType(
    {
        "all_gather_into_tensor": "all_gather",
        "all_gather_into_tensor_coalesced": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "reduce_scatter_tensor_coalesced": "reduce_scatter",
        "all_reduce": "all_reduce",
        "all_reduce_": "all_reduce",
        "all_reduce_coalesced": "all_reduce",
        "all_reduce_coalesced_": "all_reduce",
        "all_to_all_single": "all_to_all",
        "broadcast": "broadcast",
        "broadcast_": "broadcast",
    }
)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class TensorParallelTraffic(TorchDispatchMode):
    """Counts the bytes this rank sends into torch's functional collectives, per process group name and kind
    (see [Note: estimating tensor parallelism]); ``sent[group_name][kind]``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, Counter[str]] = {}
        self._dtensor = dtensor_type()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self._dtensor is not None and any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # DTensor runs first; its collectives come back through this mode
        kwargs = kwargs or {}
        if func.namespace in ("_c10d_functional", "c10d_functional"):
            kind = _KINDS.get(func._schema.name.split("::")[-1])
            group = _group_name(func, args, kwargs)
            if kind is not None and group is not None:
                self.sent.setdefault(group, Counter())[kind] += _nbytes(args[0] if args else None)
        return func(*args, **kwargs)

    def of(self, group: Any) -> dict[str, int]:
        """The bytes sent into ``group`` (a ``ProcessGroup``), per kind."""
        return {k: int(v) for k, v in self.sent.get(group.group_name, Counter()).items() if v}


def _group_name(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The ``group_name`` argument of a functional collective."""
    if "group_name" in kwargs:
        return str(kwargs["group_name"])
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "group_name" and i < len(args):
            return str(args[i])
    return None


def resolve_plan(plan: str | Plan | None, target: Any) -> Plan:
    """The plan to parallelize the target's model with: ``plan`` (a callable or ``"module.path:function"``), else
    the target module's ``tensor_parallel_plan``; refused when there is none."""
    if plan is not None:
        if isinstance(plan, str) and plan.count(":") != 1:
            raise EstimateError(
                f"tensor_parallel_plan={plan!r} is not of the form 'module.path:function'. HINT: name a function "
                "(model, tp_mesh) -> model that calls torch's parallelize_module, e.g. "
                "'flatshard.testing.llama:tensor_parallel_plan'."
            )
        if callable(plan):
            return plan
        try:
            return cast(Plan, resolve_factory(plan))
        except EstimateError as err:
            raise EstimateError(f"tensor_parallel_plan: {err}") from err
    module_name = target.split(":")[0] if isinstance(target, str) else getattr(target, "__module__", None)
    found = None
    if module_name:
        try:
            found = getattr(importlib.import_module(module_name), "tensor_parallel_plan", None)
        except ImportError:
            found = None
    if not callable(found):
        raise EstimateError(
            f"tensor_parallel_size needs a plan that parallelizes the model, and {module_name or 'the target'} "
            "defines no tensor_parallel_plan. HINT: pass --tensor-parallel-plan module.path:function "
            "(tensor_parallel_plan=...), a function (model, tp_mesh) -> model that calls torch's "
            "parallelize_module, or define tensor_parallel_plan beside the factory."
        )
    return found  # type: ignore[no-any-return]


def make_mesh(world: int, tensor_parallel_size: int) -> Any:
    """The ``(world / k, k)`` ("data_parallel", "tensor_parallel") mesh over the process group in use."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        "cpu",
        (world // tensor_parallel_size, tensor_parallel_size),
        mesh_dim_names=("data_parallel", "tensor_parallel"),
    )


def apply_plan(plan: Plan, module: nn.Module, mesh: Any, name: str) -> nn.Module:
    """``plan(module, mesh["tensor_parallel"])`` on the meta-built model, its failures explained."""
    try:
        result = plan(module, mesh["tensor_parallel"])
    except EstimateError:
        raise
    except Exception as err:
        text = str(err).rstrip(".")
        if "HINT" not in text:
            text += (
                ". HINT: the plan is called as plan(model, tp_mesh) on the model built on the meta device; run it "
                "on its own to see the full traceback"
            )
        raise EstimateError(
            f"the tensor-parallel plan {getattr(plan, '__qualname__', plan)!r} failed on {name}'s model: "
            f"{type(err).__name__}: {text}."
        ) from err
    out = result if isinstance(result, nn.Module) else module
    if not any(type(p).__name__ == "DTensor" for p in out.parameters()):
        raise EstimateError(
            f"the tensor-parallel plan {getattr(plan, '__qualname__', plan)!r} left {name}'s model without DTensor "
            "parameters. HINT: the plan must call torch's parallelize_module(model, tp_mesh, ...) on the model it "
            "is given."
        )
    return out
