"""``cpu_offload="optimizer"``: the optimizer state and its step in host memory, shards and gradients on the device.

[Note: optimizer offload]
ZeRO-Offload's split: the device keeps what forward and backward need (the shards, gathered per unit, and the
gradient shards), the host keeps what only the step needs (the optimizer state, about twice the shards' size for
Adam) and runs the step. Around each ``step()`` of an optimizer holding parameters of such units, torch's global
optimizer step hooks (the ones of ``flatshard.engine.step.whole_tensor``, installed by ``shard()``) do this:

1. Before the step (after the closure, if ``step`` was given one: the gradients are final only then), for each
   unit: the host copy of the shard (:class:`~flatshard.engine.step.host_shard.HostShard`, kept by the unit's
   handle from one step to the next) is refreshed from the device shard if anything wrote the shard since the
   last step (its version marks moved, as in 4. of [Note: whole-tensor optimizers]); the gradient shard is
   copied to the host unless the copy issued in backward, as soon as the unit's reduction was done, is still
   current (the gradient shard's version counter did not move: clipping, another micro-batch and a replaced
   ``.grad`` all move it or are seen); the CPU waits once for these copies. Then each parameter's ``.data``
   and ``.grad`` become its pieces of the host copies.
2. The optimizer steps, unchanged, on host tensors: its state is made on the host and stays there, ``step``
   included. torch picks its CPU implementation from the optimizer's arguments: ``fused=True`` runs its fused
   CPU kernel (AdamW, Adam, SGD, Adagrad), ``foreach=True`` the ``_foreach`` ops, the default the per-tensor
   loop; ``docs/benchmarks.md`` measures them (``python -m benchmarks host_step``).
3. After the step the updated pieces go back into the device shard, and ``.data`` and ``.grad`` are the device
   pieces and gradients again. On CUDA the copy back does not block the CPU: the compute stream waits for it,
   so the next forward's gathers see the update (see [Note: host copies and the streams]).

What the optimizer and everything else see between steps is what they see without offload: ``.data`` and
``.grad`` on the device, so ``clip_grad_norm_``, gradient accumulation, ``no_sync``, a ``GradScaler`` and
checkpoints work on device gradients and weights as before. Only the optimizer's state is elsewhere: its
tensors are CPU tensors, which every checkpoint path takes as they are (full files hold the plain format, sharded
directories the same pieces), so checkpoints are the files a run without offload writes, and each loads into
the other. A load puts the state straight into host memory: the optimizer's ``load_state_dict`` hooks (registered
when flatshard first sees the optimizer: the strategies' setup, a flatshard load or save, the first step) show
torch's cast a CPU stand-in of each parameter (not for a dict whose groups torch refuses: it raises after the
pre-hook, and the post-hook that puts the parameters back would never run), and any state tensor still on the
device at the next step (a ``load_state_dict`` before flatshard saw the optimizer) is moved there.

The host copy of the shard is the master copy of the weights (fp32 under mixed precision, as the shards are);
it covers the start of the shard up to the last parameter with a gradient, so the frozen base of a fine-tuned
model costs no host memory. A write into the shard that torch does not count (through ``.data``, a pointer)
between steps is not seen and is lost at the next step; so is a write into a gradient through ``.data`` after
backward: say so with ``torch.autograd.graph.increment_version``, as for whole-tensor optimizers.

Refused with a hint: an optimizer that needs whole tensors (its parameters are whole on one owner rank for the
step, on the device), and ``capturable=True`` (torch's capturable step runs on CUDA tensors only).

On a CPU device nothing is saved (the host copies are extra memory), but the same code runs, with synchronous
copies: that is what the CPU tests check against a run without offload.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from flatshard.engine.gradients import set_grad
from flatshard.engine.handle import FlatParamHandle, handle_of_param
from flatshard.engine.log_once import log_once
from flatshard.engine.step.host_shard import HostShard, VersionMark

__all__ = [
    "OffloadPlan",
    "offload_plan",
    "offloaded_post_step",
    "offloaded_pre_step",
    "refuse_whole_tensor_offload",
    "state_device",
]

log = logging.getLogger("flatshard")

_ATTR = "_flatshard_offload"  # the optimizer's attribute holding its plan
_SCALER_ATTRS = ("grad_scale", "found_inf")  # what torch's GradScaler hands a fused optimizer's step


def version_mark(handle: FlatParamHandle) -> VersionMark:
    """What tells that ``handle``'s device shard was written (see ``host_shard.VersionMark``)."""
    sharded = handle.sharded
    return (id(sharded), sharded._version, tuple(p._version for p in handle.params))


def state_device(param: torch.Tensor) -> torch.device:
    """Where an optimizer keeps ``param``'s state: host memory for a parameter of a unit with
    ``cpu_offload="optimizer"``, else the parameter's device."""
    handle = handle_of_param(param)
    if handle is not None and handle.host is not None:
        return torch.device("cpu")
    return param.device


@dataclass(eq=False)
class OffloadParam:
    """One parameter of an offloaded unit in an optimizer."""

    param: nn.Parameter
    handle: FlatParamHandle
    index: int  # in the handle's parameters
    # inside the step: the device gradient ``.grad`` gets back after it (None: not stepped here)
    device_grad: torch.Tensor | None = None
    stepped: bool = False


@dataclass(eq=False)
class OffloadPlan:
    """One optimizer's parameters of offloaded units; kept on the optimizer (see [Note: optimizer offload])."""

    key: _Key  # what the plan was made for
    params: list[OffloadParam]  # empty: none of the optimizer's parameters is offloaded
    optimizer_name: str
    on_host: bool = False  # inside the step: the parameters' .data and .grad are host pieces
    # the extent of the shard each unit's step covers (elements from its start), while on_host
    extents: dict[int, tuple[FlatParamHandle, int]] = field(default_factory=dict)
    # the GradScaler's device tensors, while on_host
    scaler_attrs: dict[str, Any] = field(default_factory=dict)
    # inside the optimizer's load_state_dict: each parameter's data, put back by the post-hook
    loading: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    hooks: tuple[RemovableHandle, RemovableHandle] | None = None  # the optimizer's load_state_dict hooks

    def recover(self) -> None:
        """After a step that raised (its post-step hook never ran) or a load that raised: the device pieces and
        gradients back in place. The host copies may be half stepped: they are copied from the device again."""
        for p, data in self.loading:
            p.data = data
        self.loading = []
        if not self.on_host:
            return
        for q in self.params:
            if q.stepped:
                q.param.data = q.handle.piece(q.index)
                set_grad(q.param, q.device_grad)
                q.device_grad, q.stepped = None, False
        for handle, _ in self.extents.values():
            assert handle.host is not None
            handle.host.in_sync = None
        self.extents = {}
        _restore_scaler_attrs(self)
        self.on_host = False


def existing_plan(optimizer: torch.optim.Optimizer) -> OffloadPlan | None:
    plan = getattr(optimizer, _ATTR, None)
    return plan if isinstance(plan, OffloadPlan) else None


@dataclass(eq=False)
class _Key:
    """What changes when an optimizer's parameters change, checked in time independent of their number (this runs
    at every step of every optimizer): each group's parameter list (``add_param_group`` adds one,
    ``rebind_optimizer`` replaces them; held, so no other list takes its id) and its length, and the unit of the
    first parameter (``shard()`` after the optimizer stepped once; held weakly, as the optimizer holds no unit)."""

    lists: tuple[list[Any], ...]
    lengths: tuple[int, ...]
    first_unit: Any  # weakref.ref to the first parameter's handle, or None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> _Key:
        lists = tuple(g["params"] for g in optimizer.param_groups)
        first = next((params[0] for params in lists if params), None)
        handle = handle_of_param(first) if first is not None else None
        return cls(lists, tuple(map(len, lists)), weakref.ref(handle) if handle is not None else None)

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        if len(groups) != len(self.lists) or any(
            g["params"] is not mine or len(mine) != n for g, mine, n in zip(groups, self.lists, self.lengths)
        ):
            return False
        first = next((params[0] for params in self.lists if params), None)
        handle = handle_of_param(first) if first is not None else None
        return (self.first_unit() if self.first_unit is not None else None) is handle


def offload_plan(optimizer: torch.optim.Optimizer) -> OffloadPlan | None:
    """The optimizer's plan, made again when its parameters changed; ``None`` when none of its parameters belongs
    to a unit with ``cpu_offload="optimizer"`` (that answer is kept on the optimizer too). Making the first plan
    with such parameters registers the optimizer's ``load_state_dict`` hooks (see [Note: optimizer offload])."""
    cached = existing_plan(optimizer)
    if cached is not None and cached.key.matches(optimizer):
        return cached if cached.params else None
    if cached is not None:
        cached.recover()
    entries = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            handle = handle_of_param(p)
            if handle is not None and handle.host is not None:
                entries.append(OffloadParam(p, handle, handle.index_of(p)))
    plan = OffloadPlan(_Key.of(optimizer), entries, type(optimizer).__name__)
    plan.hooks = cached.hooks if cached is not None else None
    if plan.hooks is None and entries:
        plan.hooks = (
            optimizer.register_load_state_dict_pre_hook(_before_load),
            optimizer.register_load_state_dict_post_hook(_after_load),
        )
    setattr(optimizer, _ATTR, plan)
    return plan if entries else None


def refuse_whole_tensor_offload(optimizer: torch.optim.Optimizer) -> None:
    """A whole-tensor optimizer steps on the device, on each parameter's owner: refuse offloaded parameters."""
    plan = offload_plan(optimizer)
    if plan is None:
        return
    name = plan.params[0].handle.names[plan.params[0].index]
    raise ValueError(
        f"flatshard: {plan.optimizer_name} needs each parameter whole (see [Note: whole-tensor optimizers]) and "
        f"holds {name!r}, a parameter of a unit sharded with cpu_offload='optimizer'; whole parameters are made on "
        "one owner rank's device for the step, so its state cannot live in host memory. HINT: use "
        "cpu_offload=True (shards and the optimizer in host memory) or cpu_offload=False for this model, or give "
        f"{plan.optimizer_name} only parameters of units sharded without cpu_offload='optimizer'."
    )


def _check_supported(optimizer: torch.optim.Optimizer, plan: OffloadPlan) -> None:
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable", False):
            raise ValueError(
                f"flatshard: {plan.optimizer_name} param group {i} has capturable=True, and cpu_offload='optimizer' "
                "steps it on CPU tensors, which torch's capturable step refuses. HINT: build the optimizer with "
                "capturable=False (fused=True is the fast CPU path)."
            )
    fused = [g.get("fused") for g in optimizer.param_groups]
    if "fused" in optimizer.defaults and not all(fused):
        log_once(
            log,
            ("offload-not-fused", plan.optimizer_name),
            "flatshard: cpu_offload='optimizer' steps %s on the CPU with torch's %s implementation; fused=True runs "
            "torch's fused CPU kernel, the fast path (see docs/benchmarks.md).",
            plan.optimizer_name,
            "foreach" if all(g.get("foreach") for g in optimizer.param_groups) else "per-tensor",
        )


def offloaded_pre_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """torch's optimizer pre-step hook for an optimizer that is no whole-tensor one (see [Note: optimizer
    offload]): parameters and gradients to the host, after the closure if the step got one."""
    plan = offload_plan(optimizer)
    if plan is None:
        return None
    plan.recover()
    _check_supported(optimizer, plan)
    # torch passes the step's own arguments: ``args[0]`` is the optimizer, ``args[1]`` a positional closure
    closure: Callable[[], Any] | None = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _to_host(optimizer, plan)
        return None

    def then_to_host(closure: Callable[[], Any] = closure) -> Any:
        # The gradients are final only after the closure; an optimizer that calls it again (LBFGS) gets the
        # device pieces back for it, updated.
        if plan.on_host:
            _to_device(plan)
        with torch.enable_grad():
            loss = closure()
        _to_host(optimizer, plan)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": then_to_host}
    return (args[0], then_to_host, *args[2:]), kwargs


def offloaded_post_step(optimizer: torch.optim.Optimizer) -> None:
    """torch's optimizer post-step hook: the updated pieces back into the device shards."""
    plan = existing_plan(optimizer)
    if plan is not None and plan.on_host:
        _to_device(plan)


# ---------------------------------------------------------------------------------------------- the moves
def _to_step(plan: OffloadPlan) -> dict[int, tuple[FlatParamHandle, int, list[OffloadParam]]]:
    """Each unit with a parameter to step (one with a gradient): the elements of its shard from the start to the
    end of the last such parameter (at least its gradient shard's), and those parameters."""
    out: dict[int, tuple[FlatParamHandle, int, list[OffloadParam]]] = {}
    for q in plan.params:
        if q.param.grad is None:
            continue
        info = q.handle.shard_infos[q.index]
        end = info.offset_in_shard + info.numel_in_shard
        handle, extent, params = out.get(id(q.handle), (q.handle, q.handle.grad_numel, []))
        params.append(q)
        out[id(q.handle)] = (handle, max(extent, end), params)
    return out


def _is_shard_view(grad: torch.Tensor, shard_grad: torch.Tensor | None, q: OffloadParam) -> bool:
    """Whether ``grad`` is the parameter's piece of the unit's gradient shard (what backward assigns)."""
    if shard_grad is None:
        return False
    info = q.handle.shard_infos[q.index]
    if info.offset_in_shard + info.numel_in_shard > shard_grad.numel():
        return False
    piece = q.handle.piece_of(shard_grad, q.index)
    return (
        grad.dtype == shard_grad.dtype and grad.shape == piece.shape and grad.data_ptr() == piece.data_ptr()
    )


def _to_host(optimizer: torch.optim.Optimizer, plan: OffloadPlan) -> None:
    """1. of [Note: optimizer offload]: the copies to the host, one wait, then host pieces in place."""
    units = _to_step(plan)
    hosts: list[HostShard] = []
    for handle, extent, mine in units.values():
        host = handle.host
        assert host is not None
        hosts.append(host)
        params = host.reserve_params(extent, handle.dtype)
        if host.in_sync != version_mark(handle):
            host.copy_params(handle.sharded, params.numel())
        shard_grad = handle.sharded_grad()
        views = [_is_shard_view(q.param.grad, shard_grad, q) for q in mine]  # type: ignore[arg-type]
        dtype = shard_grad.dtype if shard_grad is not None else handle.precision.grad
        host.reserve_grads(extent, dtype)
        # a gradient kept in a lower precision is assigned through ``.data`` (writes through it move no version
        # counter of the shard): copied at every step
        low = shard_grad is not None and shard_grad.dtype != handle.dtype
        if any(views) and (low or not host.valid_grad_copy(shard_grad)):
            assert shard_grad is not None
            host.copy_grad(shard_grad, None)
        for q, is_view in zip(mine, views, strict=True):
            if not is_view and q.param.grad is not None and q.param.grad.numel():
                host.copy_grad_piece(q.handle.shard_infos[q.index].offset_in_shard, q.param.grad)
    for host in hosts:
        host.wait()
    _state_on_host(optimizer, plan)
    for handle, _, mine in units.values():
        host = handle.host
        assert host is not None and host.params is not None and host.grads is not None
        for q in mine:
            q.device_grad, q.stepped = q.param.grad, True
            q.param.data = handle.piece_of(host.params, q.index)
            set_grad(q.param, handle.piece_of(host.grads, q.index))
    plan.extents = {key: (handle, extent) for key, (handle, extent, _) in units.items()}
    _scaler_attrs_to_host(optimizer, plan)
    plan.on_host = True


def _to_device(plan: OffloadPlan) -> None:
    """3. of [Note: optimizer offload]: device pieces and gradients back in place, the update into the shards."""
    for q in plan.params:
        if q.stepped:
            q.param.data = q.handle.piece(q.index)
            set_grad(q.param, q.device_grad)
            q.device_grad, q.stepped = None, False
    for handle, extent in plan.extents.values():
        host = handle.host
        assert host is not None
        host.copy_back(handle.sharded, extent)
        host.in_sync = version_mark(handle)
    plan.extents = {}
    _restore_scaler_attrs(plan)
    plan.on_host = False


def _state_on_host(optimizer: torch.optim.Optimizer, plan: OffloadPlan) -> None:
    """Every state tensor of an offloaded parameter in host memory (one loaded onto the device moves)."""
    cpu = torch.device("cpu")
    for q in plan.params:
        state = optimizer.state.get(q.param)
        if not state:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != cpu:
                state[key] = value.to(cpu)


def _scaler_attrs_to_host(optimizer: torch.optim.Optimizer, plan: OffloadPlan) -> None:
    """A fused optimizer stepped under a ``GradScaler`` reads the scale and the inf flag the scaler set on it:
    host copies for the host step."""
    for name in _SCALER_ATTRS:
        value = getattr(optimizer, name, None)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            plan.scaler_attrs[name] = value
            setattr(optimizer, name, value.cpu())
    plan.scaler_attrs["optimizer"] = optimizer


def _restore_scaler_attrs(plan: OffloadPlan) -> None:
    optimizer = plan.scaler_attrs.pop("optimizer", None)
    for name, value in plan.scaler_attrs.items():
        setattr(optimizer, name, value)
    plan.scaler_attrs = {}


# ---------------------------------------------------------------------------------------------- loads
def _host_stand_in(param: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``param``'s shape and dtype that holds one element (zero strides): what torch's
    ``load_state_dict`` reads a parameter's device and dtype from."""
    one = torch.zeros(1, dtype=param.dtype)
    return one.as_strided(param.shape, (0,) * param.dim())


def _before_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """The optimizer's ``load_state_dict`` pre-hook: torch casts each state tensor to its parameter's device,
    so the offloaded parameters show a CPU stand-in until the post-hook."""
    plan = offload_plan(optimizer)
    if plan is None:
        return
    plan.recover()
    if not _groups_match(optimizer, state_dict):
        return  # torch refuses it right after this hook, before it casts anything: nothing to stand in for
    for q in plan.params:
        plan.loading.append((q.param, q.param.data))
        q.param.data = _host_stand_in(q.param)


def _groups_match(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> bool:
    """torch's own check in ``load_state_dict``: as many groups, each with as many parameters. A dict it refuses
    raises after the pre-hook, and the post-hook that puts the parameters back never runs."""
    saved = state_dict.get("param_groups")
    groups = optimizer.param_groups
    return (
        isinstance(saved, (list, tuple))
        and len(saved) == len(groups)
        and all(
            isinstance(s, dict) and len(s.get("params", ())) == len(g["params"])
            for s, g in zip(saved, groups)
        )
    )


def _after_load(optimizer: torch.optim.Optimizer) -> None:
    plan = existing_plan(optimizer)
    if plan is None:
        return
    for p, data in plan.loading:
        p.data = data
    plan.loading = []
    _state_on_host(optimizer, plan)
