"""Bytes per mesh dimension of the collectives torch's dispatcher sees, the same way for every contender.

:class:`CollectiveBytes` is a ``TorchDispatchMode`` that, like torch's ``CommDebugMode``, lets DTensor turn its
operators into collectives first and then sees them: the functional collectives (``_c10d_functional``, what
DTensor and tensor-parallel plans issue) and the ``c10d`` ones (what ``torch.distributed.all_gather_into_tensor``
and friends issue, e.g. FSDP2's). Where ``CommDebugMode`` counts collectives, this one also adds up their bytes,
by the process group they ran on, named by the mesh dimension it belongs to.

A collective's bytes are its input on this rank (an all-gather's shard, a reduce-scatter's whole buffer, an
all-reduce's tensor), which is how flatshard's own counters count them (``flatshard.engine.group_traffic``).
Collectives that do not go through the dispatcher are not seen: flatshard's shared-memory transport on CPU, for
one; its bytes come from flatshard's counters.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace) -> kind
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
# the argument that holds a collective's input, by the schema's name for it
_INPUTS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors")


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Inside ``with CollectiveBytes({"data_parallel": pg, ...}) as seen:``, ``seen.bytes[(dimension, kind)]`` and
    ``seen.counts[(dimension, kind)]`` add up the collectives issued on each named group (``"other"``: any other
    group)."""

    def __init__(self, groups: dict[str, Any]) -> None:
        super().__init__()
        self.names = {pg.group_name: dim for dim, pg in groups.items()}
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.counts: Counter[tuple[str, str]] = Counter()

    def _dimension(self, group: Any) -> str:
        """The dimension of a functional collective's group name or a ``c10d`` op's group (a ``ScriptObject``
        that ``ProcessGroup.unbox`` turns back into the group)."""
        if isinstance(group, torch.ScriptObject):
            import torch.distributed as dist

            group = dist.ProcessGroup.unbox(group)
        name = group if isinstance(group, str) else getattr(group, "group_name", None)
        return self.names.get(name, "other") if name is not None else "other"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented  # DTensor first: it lowers to the collectives seen below
        packet = func._overloadpacket
        kind = (
            _KINDS.get(packet.__name__) if packet._qualified_op_name.split("::")[0] in _NAMESPACES else None
        )
        if kind is not None:
            named = dict(zip((a.name for a in func._schema.arguments), args))
            named.update(kwargs)
            group = named.get("group_name", named.get("process_group"))
            key = (self._dimension(group), kind)
            self.bytes[key] += next((_nbytes(named[k]) for k in _INPUTS if k in named), 0)
            self.counts[key] += 1
        return func(*args, **kwargs)

    def per_dimension(self) -> dict[str, dict[str, int]]:
        """``{dimension: {kind: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (dim, kind), n in self.bytes.items():
            out.setdefault(dim, {})[kind] = n
        return out
