"""Precision plugin: Lightning's precision flags mapped onto flatshard's mixed precision.

[Note: precision flags]
- ``"32-true"``: everything in fp32.
- ``"bf16-mixed"`` / ``"16-mixed"``: fp32 shards (master weights, optimizer, checkpoints); each unit is
  gathered and computes in bf16 / fp16 (half the all-gather bytes), gradients are reduced in bf16 / fp16
  (half the reduce-scatter bytes, and no fp32 copy of the unsharded gradient; Lightning's FSDP strategy
  does the same) and accumulated into fp32 gradient shards, and the step runs under ``torch.autocast``
  so numerically sensitive ops (softmax, norms, losses) run in fp32. To reduce in fp32 (exact sums over
  many ranks, at twice the bytes), pass ``mixed_precision=MixedPrecision(reduce_dtype=torch.float32)``:
  dtypes left unset in a given ``MixedPrecision`` take the flag's. ``"16-mixed"`` scales the loss with :class:`FlatShardGradScaler`, whose inf/NaN check agrees
  across ranks, so every rank skips the same steps.
- ``"bf16-true"`` / ``"16-true"``: the model is cast to the low dtype before sharding (built in it under
  ``init_module``); there is no fp32 copy. Inputs are cast to the dtype, outputs back to fp32.

A ``mixed_precision=`` given to the strategy replaces the dtypes a mixed flag implies, field by field: what it
leaves unset keeps the flag's (autocast and the scaler stay).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision.half import HalfPrecision
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from flatshard.engine import MixedPrecision, clip_grad_norm_params_

__all__ = [
    "FlatShardFabricHalfPrecision",
    "FlatShardGradScaler",
    "FlatShardPrecision",
    "mixed_precision_for",
    "sharded_scaler",
    "to_flatshard_precision",
]

PrecisionFlag = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
_FLAGS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_LOW = MappingProxyType({"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32})
_AMP_KEY = LightningMixedPrecision.__qualname__  # where Lightning's AMP plugin keeps its scaler state


class FlatShardGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` for sharded gradients: each rank checks only its shards for inf/NaN, so the
    verdict is combined over ``process_group`` (MAX) before any rank decides to step or skip.

    Args:
        device: the device type of the gradients (``"cuda"`` or ``"cpu"``).
        process_group: the ranks whose verdicts are combined. Default: all ranks.
        **kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``.
    """

    def __init__(self, device: str = "cuda", process_group: Any | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group

    @override
    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        # torch copies inv_scale and found_inf to each gradient's device with non_blocking=True, and the CPU
        # kernel reads the copies at once: for CPU gradients (CPU offload) of a CUDA scale that read may come
        # before the copy lands, so an overflowing step would not be skipped. Hand such gradients CPU values
        # made by a synchronous copy; the copies to CUDA gradients (from pageable memory) stay safe.
        if inv_scale.device.type != "cpu" and _has_cpu_grads(optimizer):
            inv_scale, found_inf = inv_scale.cpu(), found_inf.cpu()
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # type: ignore[no-any-return]

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        if not (dist.is_available() and dist.is_initialized()):
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        # One collective per optimizer on every rank, even one whose shards hold no gradient at all.
        any_inf = torch.zeros(
            (), dtype=torch.float32, device=self._scale.device if self._scale is not None else "cpu"
        )
        for value in found.values():
            any_inf += value.to(any_inf.device)
        dist.all_reduce(any_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        if not found:
            found[any_inf.device] = any_inf.clone()
        for value in found.values():
            value.copy_(any_inf.to(value.device))


def _has_cpu_grads(optimizer: Optimizer) -> bool:
    return any(
        p.grad is not None and p.grad.device.type == "cpu"
        for group in optimizer.param_groups
        for p in group["params"]
    )


def _convert(data: Any, dtype: torch.dtype) -> Any:
    def cast_tensor(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) else t

    return apply_to_collection(data, function=cast_tensor, dtype=Tensor)


class FlatShardPrecision(Precision):
    """Lightning precision for flatshard; see [Note: precision flags].

    Args:
        precision: ``"32-true"`` (default), ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        device: device type for autocast and the grad scaler. Default: ``"cuda"`` if available, else ``"cpu"``.
        scaler: the scaler for ``"16-mixed"``; default: a :class:`FlatShardGradScaler`.
    """

    # Its on_save_checkpoint adds the scaler's state, nothing else: see [Note: streamed Trainer saves].
    flatshard_stream_safe = True

    def __init__(
        self,
        precision: PrecisionFlag = "32-true",
        device: str | None = None,
        scaler: FlatShardGradScaler | None = None,
    ) -> None:
        if precision not in _FLAGS:
            raise ValueError(
                f"precision={precision!r} is not supported by flatshard. HINT: use one of {', '.join(_FLAGS)}."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a grad scaler, got {scaler!r}.")
        if scaler is not None and not isinstance(scaler, FlatShardGradScaler):
            raise TypeError(
                f"scaler must be a flatshard FlatShardGradScaler (its inf check spans all shards), got "
                f"{type(scaler).__name__}. HINT: pass FlatShardGradScaler(device, init_scale=...) instead."
            )
        self.precision = precision  # type: ignore[assignment]
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is None and precision == "16-mixed":
            scaler = FlatShardGradScaler(self.device)
        self.scaler = scaler
        low = _LOW[precision.split("-")[0]]
        self._low = low
        self._mixed = precision.endswith("-mixed")
        self._true_low = precision.endswith("-true") and low != torch.float32

    @property
    def autocast(self) -> bool:
        """Whether steps run under ``torch.autocast`` (the ``*-mixed`` flags)."""
        return self._mixed

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return cast_module(module, self._low) if self._true_low else module

    def _default_dtype(self) -> AbstractContextManager[Any]:
        return _default_dtype(self._low) if self._true_low else nullcontext()

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return self._default_dtype()

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self._default_dtype()

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        if self._mixed:
            return torch.autocast(self.device, dtype=self._low, cache_enabled=False)
        return self._default_dtype()

    @override
    def convert_input(self, data: Any) -> Any:
        return _convert(data, self._low) if self._true_low else data

    @override
    def convert_output(self, data: Any) -> Any:
        return _convert(data, torch.get_default_dtype()) if self._true_low else data

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                "precision='16-mixed' (loss scaling) does not work with LBFGS. HINT: use bf16-mixed."
            )
        closure_result = closure()
        skipped = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skipped:
            self.scaler.unscale_(optimizer)  # before clipping and on_before_optimizer_step
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_params_(self.main_params(optimizer), float(clip_val))

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning files state_dict() under this class's name; the scaler's state also goes under the key
        # Lightning's own AMP plugin reads, so a "16-mixed" run resumed under ddp or auto keeps its scale.
        if self.scaler is not None:
            checkpoint[_AMP_KEY] = self.scaler.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint written under ddp / auto (or an old Lightning): its scaler state, if ours is absent.
        if type(self).__qualname__ in checkpoint:
            return
        for key in (_AMP_KEY, "native_amp_scaling_state"):
            if checkpoint.get(key):
                self.load_state_dict(checkpoint[key])
                return


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` for every floating-point parameter and buffer, except inside torchmetrics
    ``Metric`` modules: metric states keep their dtype (``*-true`` flags)."""
    from torchmetrics import Metric

    skipped = {sub for m in module.modules() if isinstance(m, Metric) for sub in m.modules()}
    for m in module.modules():
        if m not in skipped:
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return module


def sharded_scaler(given: torch.amp.GradScaler | None, device: str) -> FlatShardGradScaler | None:
    """A :class:`FlatShardGradScaler` with ``given``'s settings (``None`` stays ``None``)."""
    if given is None or isinstance(given, FlatShardGradScaler):
        return given
    return FlatShardGradScaler(
        device,
        init_scale=given.get_scale() if given.is_enabled() else 2.0**16,
        growth_factor=given.get_growth_factor(),
        backoff_factor=given.get_backoff_factor(),
        growth_interval=given.get_growth_interval(),
        enabled=given.is_enabled(),
    )


def mixed_precision_for(flag: str, given: MixedPrecision | None = None) -> MixedPrecision | None:
    """The engine dtypes for precision ``flag``: the strategy's ``mixed_precision`` if ``given``, else what a
    ``*-mixed`` flag stands for (see [Note: precision flags]).

    A ``given`` ``param_dtype`` must agree with the flag: ``*-true`` flags keep the whole model in their dtype
    (nothing to gather in another), and ``*-mixed`` flags compute under autocast in theirs (``float32``, to
    gather full-precision weights, is allowed). ``"32-true"`` takes any.
    """
    low_name, kind = flag.split("-")
    low = _LOW[low_name]
    if given is None:
        return MixedPrecision(param_dtype=low, reduce_dtype=low) if kind == "mixed" else None
    if kind == "mixed" and low != torch.float32:  # unset dtypes: what the flag stands for
        given = replace(
            given,
            param_dtype=given.param_dtype or low,
            reduce_dtype=given.reduce_dtype or given.param_dtype or low,
        )
    param = given.param_dtype
    if param is None or low == torch.float32 or param == low:
        return given
    other = {"bf16": "16", "16": "bf16"}[low_name]
    if kind == "true":
        fix = (
            f"precision='32-true' (fp32 throughout) or '{low_name}-mixed' (fp32 master weights, {low} compute)"
            if param == torch.float32
            else f"precision='32-true' with this mixed_precision for {param} compute over fp32 master weights"
        )
        raise ValueError(
            f"precision={flag!r} keeps the whole model in {low} with no fp32 copy, so mixed_precision.param_dtype="
            f"{param} has nothing to gather it from. HINT: use {fix}; with {flag!r} leave param_dtype unset."
        )
    if param != torch.float32:
        raise ValueError(
            f"precision={flag!r} runs the step under autocast in {low}, but mixed_precision.param_dtype={param}. "
            f"HINT: use param_dtype={low} (or torch.float32 to gather full-precision weights), or "
            f"precision='{other}-mixed'."
        )
    return given


def to_flatshard_precision(plugin: Any) -> FlatShardPrecision | None:
    """Map the plugin Lightning built from ``precision=`` onto ours; refuse what flatshard cannot honour."""
    if plugin is None or isinstance(plugin, FlatShardPrecision):
        return plugin
    if type(plugin) is Precision:
        return FlatShardPrecision("32-true")
    if type(plugin) is HalfPrecision and plugin.precision in _FLAGS:
        return FlatShardPrecision(cast(PrecisionFlag, plugin.precision))
    if type(plugin) is LightningMixedPrecision and plugin.precision in _FLAGS:
        scaler = sharded_scaler(plugin.scaler, plugin.device)
        return FlatShardPrecision(cast(PrecisionFlag, plugin.precision), device=plugin.device, scaler=scaler)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"precision={name!r} ({type(plugin).__name__}) is not supported with flatshard. HINT: use one of "
        f"{', '.join(_FLAGS)}, or flatshard.lightning.FlatShardPrecision."
    )


class FlatShardFabricHalfPrecision(FabricHalfPrecision):
    """Fabric's ``"bf16-true"`` / ``"16-true"`` for flatshard: torchmetrics states are not cast."""

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return cast_module(module, self._desired_input_dtype)
