"""Float8 all-gathers for torchao's ``Float8Linear`` weights.

[Note: float8 all-gathers]
torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear``, whose matmuls run in float8;
with ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` it also wraps each weight in a tensor subclass
that asks a sharding engine to cast the weight to float8 *before* the all-gather. flatshard honours that switch:

- at ``shard()`` the subclass weight becomes a plain ``nn.Parameter`` of its high-precision tensor (the same
  Python object, :func:`torch.utils.swap_tensors`, so an optimizer built before still holds it). The shard,
  the gradient shard, the optimizer and every checkpoint see high-precision weights, so a checkpoint loads
  into a model without float8.
- the unit's float8 weights get a flat parameter of their own (:class:`Float8Weights` on its handle). Its
  gather casts the local shard to float8, piece by piece with each weight's scale, and all-gathers one byte
  per element: half of bf16's bytes, a quarter of fp32's.
- each weight's scale is torchao's tensorwise dynamic scale (``amax_to_scale`` of the weight's absolute
  maximum), the same value torchao computes on the unsharded weight: every rank takes the maximum over its
  pieces and one all-reduce (``MAX``) per shard group gives all weights of all units their scales at once
  (:class:`Float8Scales`, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``). The root computes them at
  the start of every forward outside backward (the weights may have changed since); a unit gathered before
  any root forward computes its own. Inside :func:`~flatshard.join` they are computed when the block begins.
- the module sees, for each float8 weight, a torchao ``Float8TrainingTensor`` of the gathered bytes and the
  scale (in the compute dtype, as FSDP2's ``fsdp_post_all_gather`` makes it): ``Float8Linear`` uses it without
  casting again. Its gradient arrives in the compute dtype and is reduced like any other.

Only torchao's dynamic tensorwise weight scaling has a float8 all-gather (torchao allows no other with
``enable_fsdp_float8_all_gather``); other recipes (rowwise) gather high-precision weights and ``Float8Linear``
casts them in its forward, as under FSDP2. Not with ``cpu_offload=True`` (the shard on the host):
``cpu_offload="optimizer"`` keeps the shard on the device and works.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.flat_param import ShardInfo
from flatshard.engine.transport import comm

__all__ = [
    "Float8Scales",
    "Float8WeightConfig",
    "Float8Weights",
    "float8_weight_config",
    "plain_float8_weights",
    "refresh_scales",
]

_LINEAR_MODULE = "torchao.float8.float8_linear"
_CAST_MODULE = "torchao.float8.fsdp_utils"


@dataclass(frozen=True)
class Float8WeightConfig:
    """How one ``Float8Linear`` weight is gathered: its float8 dtype, torchao's matmul config for it, and
    whether scales are rounded down to a power of two."""

    dtype: torch.dtype
    mm_config: Any  # torchao's LinearMMConfig
    pow2_scales: bool


def float8_weight_config(module: nn.Module, name: str) -> Float8WeightConfig | None:
    """The float8 gather of ``module``'s parameter ``name``: set for the weight of a torchao ``Float8Linear``
    whose config enables ``enable_fsdp_float8_all_gather``, else ``None``. Raises for a configuration that asks
    for a float8 all-gather flatshard cannot do."""
    # no Float8Linear exists before torchao.float8 is imported
    linear_module = sys.modules.get(_LINEAR_MODULE)
    if linear_module is None or name != "weight" or not isinstance(module, linear_module.Float8Linear):
        return None
    config = module.config
    if not config.enable_fsdp_float8_all_gather:
        return None
    from torchao.float8.config import ScalingGranularity, ScalingType

    cast = config.cast_config_weight
    if (
        cast.scaling_type is not ScalingType.DYNAMIC
        or cast.scaling_granularity is not ScalingGranularity.TENSORWISE
    ):
        raise ValueError(
            f"a Float8Linear asks for a float8 all-gather with weight scaling {cast.short_str()!r}; only dynamic "
            "tensorwise scaling has one. HINT: convert with Float8LinearConfig(enable_fsdp_float8_all_gather=True) "
            "and the default (tensorwise) weight cast, or leave enable_fsdp_float8_all_gather off."
        )
    return Float8WeightConfig(
        cast.target_dtype, module.linear_mm_config, bool(config.round_scales_to_power_of_2)
    )


def plain_float8_weights(module: nn.Module, ignored: Iterable[nn.Module] = ()) -> int:
    """Turn every torchao float8-cast weight subclass under ``module`` into a plain ``nn.Parameter`` of its
    high-precision tensor, in place (the same Python object); returns how many. See [Note: float8 all-gathers]."""
    cast_module = sys.modules.get(_CAST_MODULE)
    if cast_module is None:
        return 0
    cls = cast_module.WeightWithDynamicFloat8CastTensor
    skip = {id(m) for m in ignored}
    seen: set[int] = set()
    for m in module.modules():
        if id(m) in skip:
            continue
        for p in m._parameters.values():
            if p is None or id(p) in seen or not isinstance(p, cls):
                continue
            seen.add(id(p))
            inner = p._tensor.detach()  # type: ignore[attr-defined]
            torch.utils.swap_tensors(p, nn.Parameter(inner, requires_grad=p.requires_grad))
    return len(seen)


class Float8Weights:
    """A float8 flat parameter's casts: the weights' configs, their current scales, and how the gathered
    bytes become ``Float8TrainingTensor`` views. Owned by the :class:`~flatshard.engine.handle.FlatParamHandle`
    whose flat parameter holds these weights (see [Note: float8 all-gathers])."""

    def __init__(self, configs: Sequence[Float8WeightConfig]) -> None:
        dtypes = {c.dtype for c in configs}
        pow2 = {c.pow2_scales for c in configs}
        if len(dtypes) != 1 or len(pow2) != 1:
            raise ValueError(
                "a flat parameter gathers one float8 dtype with one scale rule; these Float8Linear weights mix "
                f"{sorted(map(str, dtypes))} and power-of-two scales {sorted(pow2)}. HINT: convert the unit's "
                "linears with one Float8LinearConfig."
            )
        self.configs = tuple(configs)
        self.dtype: torch.dtype = next(iter(dtypes))
        self.pow2_scales = next(iter(pow2))
        self.scales: torch.Tensor | None = None  # float32, one per weight; set by Float8Scales

    @staticmethod
    def local_amax(pieces: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The absolute maximum of each weight's piece of the local shard (0 for an empty piece), float32."""
        out = torch.zeros(len(pieces), dtype=torch.float32, device=device)
        held = [i for i, p in enumerate(pieces) if p.numel()]
        if held:  # one kernel for all pieces; the infinity norm has no value on an empty one
            norms = torch._foreach_norm([pieces[i] for i in held], ord=float("inf"))
            out[torch.tensor(held, device=device)] = torch.stack(norms).to(torch.float32)
        return out

    def set_amax(self, amax: torch.Tensor) -> None:
        """Scales from the weights' global absolute maxima, as torchao computes them."""
        from torchao.float8.float8_utils import amax_to_scale

        self.scales = amax_to_scale(amax, self.dtype, self.pow2_scales)

    def cast_into(self, out: torch.Tensor, shard: torch.Tensor, infos: Sequence[ShardInfo]) -> None:
        """``shard`` (high precision, 1-D) cast to float8 into ``out``, each weight's piece with its scale;
        padding becomes zeros."""
        scales = self.scales
        assert scales is not None, "a float8 gather needs its scales (Float8Scales.refresh)"
        top = torch.finfo(self.dtype).max
        end = 0
        for i, info in enumerate(infos):
            if not info.numel_in_shard:
                continue
            lo, hi = info.offset_in_shard, info.offset_in_shard + info.numel_in_shard
            # torchao's cast: upcast, scale, saturate, convert (hp_tensor_and_scale_to_float8)
            scaled = shard[lo:hi].to(torch.float32) * scales[i]
            out[lo:hi].copy_(scaled.clamp_(-top, top))
            end = max(end, hi)
        if end < out.numel():
            out[end:].zero_()

    def wrap(
        self, views: Sequence[torch.Tensor], indices: Sequence[int], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The float8 views ``views`` (weights ``indices``) as ``Float8TrainingTensor`` weights of ``dtype``."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        scales = self.scales
        assert scales is not None
        return [
            Float8TrainingTensor(
                v,
                scales[i],
                dtype,
                self.configs[i].mm_config,
                gemm_input_role=GemmInputRole.WEIGHT,
            )
            for v, i in zip(views, indices, strict=True)
        ]


class Float8Scales:
    """The scales of a root's float8 flat parameters, computed together: one all-reduce per shard group.
    Owned by the root's :class:`~flatshard.engine.runtime.RootContext` (see [Note: float8 all-gathers])."""

    def __init__(self, handles: Sequence[Any]) -> None:
        by_group: dict[int, list[Any]] = {}
        for h in handles:
            if h.float8 is not None:
                by_group.setdefault(id(h.shard_group), []).append(h)
        self.groups = list(by_group.values())  # the float8 flat parameters of each shard group

    def __bool__(self) -> bool:
        return bool(self.groups)

    def refresh(self, step: int = 0) -> None:
        """Every float8 weight's scale from the current shards."""
        for members in self.groups:
            refresh_scales(members, step)


def refresh_scales(handles: Sequence[Any], step: int = 0) -> None:
    """Scales for ``handles`` (float8 flat parameters of one shard group) from their shards: local maxima, one
    all-reduce, then torchao's scale rule."""
    first = handles[0]
    pieces = [h.piece(i) for h in handles for i in range(len(h.params))]
    amax = Float8Weights.local_amax(pieces, first.device)
    if first.shard_world > 1:
        comm.all_reduce_max(amax, first.shard_group, where=("float8 weights", "scales", step))
    counts = [len(h.params) for h in handles]
    for h, part in zip(handles, torch.split(amax, counts), strict=True):
        h.float8.set_amax(part)
