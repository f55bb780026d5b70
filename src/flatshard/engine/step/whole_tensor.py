"""Optimizers that need each parameter whole (Muon, Adafactor, Shampoo-like) on sharded parameters.

[Note: whole-tensor optimizers]
Between steps a sharded parameter is a 1-D piece of its unit's shard, and so is its gradient. An elementwise
optimizer (SGD, AdamW) updates each piece on its own, and the pieces together are the unsharded update. An
optimizer that looks at a matrix as a whole (Muon orthogonalises the momentum by Newton-Schulz iterations,
Adafactor keeps row and column statistics, Shampoo-style preconditioners multiply by the matrix) cannot: torch's
Muon refuses a 1-D gradient, Adafactor would silently treat the piece as a vector.

So around ``step()`` of such an optimizer each of its sharded parameters is made whole on exactly one rank of its
shard group, its owner, and the optimizer runs there on the whole tensor, unchanged:

1. Owners are chosen once per optimizer (and again if its parameters change), the same on every rank: parameters
   by decreasing cost (elements times the smaller side for a matrix, the Newton-Schulz work; elements otherwise)
   each go to the rank with the least cost so far, so owners share the work and the optimizer state.
2. When the gradients are final (after the closure, if ``step`` was given one; otherwise at once), one
   all-to-all over the shard group sends each rank's pieces of every such parameter, values and gradient, to
   its owner. The owner sets the parameter's ``.data`` and ``.grad`` to the whole tensors; every other rank sets
   the gradient to ``None`` for the step, so the optimizer skips the parameter there (and keeps no state for it).
3. After the step, a second all-to-all sends each rank its piece of every updated parameter, copied into the
   shard; ``.data`` and ``.grad`` are the pieces again.

The optimizer state of such a parameter is therefore whole, on its owner only: the memory of sharding is kept,
divided by ownership rather than by elements. Per step the traffic is the whole-tensor parameters once to the
owners (values and gradients) and once back (values), a fraction ``(N-1)/N`` of each crossing ranks. Hybrid
sharding runs the same owners in every replica group. NO_SHARD (one rank per shard group) holds parameters
whole already: nothing happens.

The built-in optimizers that need whole tensors are recognised by class (``torch.optim.Muon``,
``torch.optim.Adafactor``); any other class is declared with :func:`register_whole_tensor_optimizer` (or the
``whole_tensor_optimizers`` argument of ``shard()`` and the strategies, which registers them). The hooks are
torch's global optimizer step hooks, so the Trainer, Fabric and plain loops all take this path without a call
of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flatshard.engine.handle import FlatParamHandle, handle_of_param

__all__ = ["is_whole_tensor_optimizer", "register_whole_tensor_optimizer", "whole_tensor_classes"]

_BUILTIN = tuple(
    c for c in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if c
)
_registered: list[type] = []
_lock = threading.Lock()
_hooks_installed = False


def whole_tensor_classes() -> tuple[type, ...]:
    """The optimizer classes handled as needing whole tensors: torch's and the registered ones."""
    return _BUILTIN + tuple(_registered)


def register_whole_tensor_optimizer(cls: type) -> type:
    """Declare that ``cls`` (an optimizer class) needs each parameter whole; see [Note: whole-tensor optimizers].

    Usable as a class decorator. Subclasses are covered too.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"register_whole_tensor_optimizer takes an optimizer class (a torch.optim.Optimizer subclass), got "
            f"{cls!r}."
        )
    with _lock:
        if cls not in _registered:
            _registered.append(cls)
    install_hooks()
    return cls


def is_whole_tensor_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, whole_tensor_classes())


@dataclass
class _Param:
    """One sharded parameter of a whole-tensor optimizer."""

    param: torch.nn.Parameter
    handle: FlatParamHandle
    index: int
    owner: int  # rank in the shard group
    shape: torch.Size
    counts: list[int]  # elements of this parameter in each rank's shard, by group rank
    starts: list[int]  # where each rank's elements begin in the flattened parameter


@dataclass
class _Group:
    """The parameters of one shard group (and device and dtype): they travel in one all-to-all."""

    group: Any
    world: int
    rank: int
    device: torch.device
    dtype: torch.dtype
    params: list[_Param] = field(default_factory=list)


@dataclass
class _Plan:
    key: tuple[int, ...]  # ids of the optimizer's parameters when planned
    groups: list[_Group]
    stashed: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    active: bool = False


# per optimizer: the ids of its parameters when planned, and the plan (None: nothing of it is sharded)
_PLANS: WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, ...], _Plan | None]] = WeakKeyDictionary()


def _cost(shape: torch.Size) -> int:
    numel = int(shape.numel())
    return numel * min(shape[-2:]) if len(shape) >= 2 else numel


def _plan(optimizer: torch.optim.Optimizer) -> _Plan | None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    key = tuple(id(p) for p in params)
    cached = _PLANS.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    groups: dict[tuple[int, torch.device, torch.dtype], _Group] = {}
    for p in params:
        handle = handle_of_param(p)
        if handle is None or handle.shard_world == 1:  # not sharded: whole already
            continue
        i = handle.index_of(p)
        g = groups.get((id(handle.shard_group), handle.device, handle.dtype))
        if g is None:
            g = groups[(id(handle.shard_group), handle.device, handle.dtype)] = _Group(
                handle.shard_group, handle.shard_world, handle.shard_rank, handle.device, handle.dtype
            )
        infos = [handle.layout.shard_infos(r)[i] for r in range(handle.shard_world)]
        g.params.append(
            _Param(
                p,
                handle,
                i,
                -1,
                handle.layout.shapes[i],
                [x.numel_in_shard for x in infos],
                [x.offset_in_param for x in infos],
            )
        )
    for g in groups.values():  # owners: the largest cost first, each to the least loaded rank
        load = [0] * g.world
        for item in sorted(g.params, key=lambda q: -_cost(q.shape)):
            owner = min(range(g.world), key=lambda r: (load[r], r))
            item.owner = owner
            load[owner] += _cost(item.shape)
    plan = _Plan(key, list(groups.values())) if groups else None
    _PLANS[optimizer] = (key, plan)
    return plan


def _gather_to_owners(plan: _Plan) -> None:
    """Step 2 of [Note: whole-tensor optimizers]: values and gradients to the owners, whole tensors put in place."""
    plan.stashed = []
    for g in plan.groups:
        live = [q for q in g.params if q.param.grad is not None]
        send: list[list[torch.Tensor]] = [[] for _ in range(g.world)]
        for q in live:
            piece = q.handle.piece(q.index).detach().reshape(-1)
            grad = q.param.grad
            assert grad is not None
            send[q.owner] += [piece, grad.detach().reshape(-1).to(g.dtype)]
        in_splits = [sum(t.numel() for t in ts) for ts in send]
        mine = [q for q in live if q.owner == g.rank]
        out_splits = [2 * sum(q.counts[s] for q in mine) for s in range(g.world)]
        flat_in = torch.cat([t.to(g.device) for ts in send for t in ts]) if any(in_splits) else None
        flat_out = torch.empty(sum(out_splits), dtype=g.dtype, device=g.device)
        dist.all_to_all_single(
            flat_out,
            flat_in if flat_in is not None else torch.empty(0, dtype=g.dtype, device=g.device),
            out_splits,
            in_splits,
            group=g.group,
        )
        wholes = {id(q): torch.empty(q.shape.numel(), dtype=g.dtype, device=g.device) for q in mine}
        grads = {id(q): torch.empty(q.shape.numel(), dtype=g.dtype, device=g.device) for q in mine}
        pos = 0
        for s in range(g.world):  # from each source: its (value, gradient) pieces of my parameters, in order
            for q in mine:
                n, at = q.counts[s], q.starts[s]
                wholes[id(q)][at : at + n].copy_(flat_out[pos : pos + n])
                grads[id(q)][at : at + n].copy_(flat_out[pos + n : pos + 2 * n])
                pos += 2 * n
        for q in live:
            plan.stashed.append((q.param, q.param.grad))
            if q.owner == g.rank:
                shard_device = q.param.device
                q.param.data = wholes[id(q)].view(q.shape).to(shard_device)
                q.param.grad = grads[id(q)].view(q.shape).to(shard_device, q.param.dtype)
            else:
                q.param.grad = None
    plan.active = True


def _scatter_from_owners(plan: _Plan) -> None:
    """Step 3 of [Note: whole-tensor optimizers]: each rank's pieces of the updated parameters back to it."""
    stashed = dict((id(p), grad) for p, grad in plan.stashed)
    for g in plan.groups:
        live = [q for q in g.params if id(q.param) in stashed]
        mine = [q for q in live if q.owner == g.rank]
        send = [
            q.param.detach().reshape(-1)[q.starts[d] : q.starts[d] + q.counts[d]].to(g.device, g.dtype)
            for d in range(g.world)
            for q in mine
        ]
        in_splits = [sum(q.counts[d] for q in mine) for d in range(g.world)]
        out_splits = [sum(q.counts[g.rank] for q in live if q.owner == s) for s in range(g.world)]
        flat_in = torch.cat(send) if send else torch.empty(0, dtype=g.dtype, device=g.device)
        flat_out = torch.empty(sum(out_splits), dtype=g.dtype, device=g.device)
        dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=g.group)
        pos = 0
        for s in range(g.world):
            for q in live:
                if q.owner != s:
                    continue
                n = q.counts[g.rank]
                q.handle.piece(q.index).detach().reshape(-1).copy_(flat_out[pos : pos + n])
                pos += n
        for q in live:
            q.param.data = q.handle.piece(q.index)
            q.param.grad = stashed[id(q.param)]
    plan.stashed = []
    plan.active = False


def _restore(plan: _Plan) -> None:
    """Pieces back in place after a step that raised (its post-step hook never ran); the shards are unchanged."""
    for p, grad in plan.stashed:
        handle = handle_of_param(p)
        if handle is not None:
            p.data = handle.piece(handle.index_of(p))
            p.grad = grad
    plan.stashed = []
    plan.active = False


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not is_whole_tensor_optimizer(optimizer):
        return None
    plan = _plan(optimizer)
    if plan is None:
        return None
    if plan.active:  # the last step raised between the two exchanges
        _restore(plan)
    # torch passes the step's own arguments: ``args[0]`` is the optimizer, ``args[1]`` a positional closure
    closure: Callable[[], Any] | None = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _gather_to_owners(plan)
        return None

    def gathered_after(closure: Callable[[], Any] = closure) -> Any:  # the gradients are final only after it
        loss = closure()
        _gather_to_owners(plan)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": gathered_after}
    return (args[0], gathered_after, *args[2:]), kwargs


def _post_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cached = _PLANS.get(optimizer)
    if cached is not None and cached[1] is not None and cached[1].active:
        _scatter_from_owners(cached[1])


def install_hooks() -> None:
    """Register the global optimizer step hooks once per process (``shard()`` does)."""
    global _hooks_installed
    with _lock:
        if _hooks_installed:
            return
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _hooks_installed = True


def managed_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.nn.Parameter]:
    """The optimizer's parameters that flatshard shards (for checks and messages)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            handle = handle_of_param(p)
            if handle is not None and handle.shard_world > 1:
                yield p
