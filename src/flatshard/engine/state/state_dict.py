"""``get_state_dict`` / ``set_state_dict``: the user-facing pair over a model and its optimizer(s), full or sharded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.state.full_model import (
    check_full_model_state_dict,
    load_full_model_state_dict,
    plan_full_model_state_dict,
)
from flatshard.engine.state.full_optim import convert_full_optim_state_dict, plan_full_optim_state_dict
from flatshard.engine.state.sharded import (
    ParamShard,
    local_param_targets,
    sharded_model_state_dict,
    sharded_optim_state_dict,
    to_local_model_state,
    to_local_optim_state,
)
from flatshard.engine.state.stream_gather import gather_by_unit, gather_items
from flatshard.engine.state.whole_state import after_load
from flatshard.engine.transport.comm import global_rank

__all__ = ["FullStates", "get_state_dict", "optimizer_list", "set_state_dict"]

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def get_state_dict(
    module: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    full: bool = True,
    rank0_only: bool = True,
    cpu_offload: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Return ``(model_state, optimizer_state)``; call it on every rank.

    Args:
        module: a module sharded with ``flatshard.shard``.
        optimizer: an optimizer, a list of optimizers, or ``None``. The optimizer state is then the plain
            format (a list for a list), or ``None``.
        full: ``True``: gather full, consolidated state. ``False``: return this rank's sharded state without
            any communication: parameters (and elementwise optimizer state) as :class:`ParamShard` views of
            the live tensors, the optimizer state keyed by parameter name (see ``flatshard.save_checkpoint``
            to write it to disk and reload it on any world size). Default: ``True``.
        rank0_only: (full state) only global rank 0 receives the state; other ranks get empty dicts.
            Default: ``True``.
        cpu_offload: (full state) copy the gathered tensors to CPU, as torch's ``StateDictOptions(cpu_offload=...)``
            (not the ``cpu_offload`` sharding option, which keeps shards in CPU memory). Default: ``True``.
    """
    if not full:
        sharded_model = sharded_model_state_dict(module)
        if optimizer is None:
            return sharded_model, None
        if isinstance(optimizer, torch.optim.Optimizer):
            return sharded_model, sharded_optim_state_dict(module, optimizer)
        return sharded_model, [sharded_optim_state_dict(module, o) for o in optimizer]
    # One gather moves the model and every optimizer (see [Note: streamed full-state gathers]).
    keep = global_rank() == 0 or not rank0_only
    optimizers = (
        []
        if optimizer is None
        else [optimizer]
        if isinstance(optimizer, torch.optim.Optimizer)
        else list(optimizer)
    )
    plans = [plan_full_model_state_dict(module, keep=keep, to_cpu=cpu_offload)]
    plans += [plan_full_optim_state_dict(module, o, keep=keep, to_cpu=cpu_offload) for o in optimizers]
    results = gather_items([item for items, _ in plans for item in items], keep)
    built: list[Any] = []
    for items, assemble in plans:
        built.append(assemble(results[: len(items)]))
        results = results[len(items) :]
    model_state, states = built[0], built[1:]
    if optimizer is None:
        return model_state, None
    return model_state, states[0] if isinstance(optimizer, torch.optim.Optimizer) else states


def set_state_dict(
    module: nn.Module,
    optimizer: OptimizerArg,
    model_state: Mapping[str, Any] | None,
    optimizer_state: Any = None,
    *,
    full: bool = True,
    strict: bool = True,
) -> None:
    """Load model and optimizer state on every rank (each rank keeps only its slices).

    Args:
        module: a module sharded with ``flatshard.shard``.
        optimizer: the optimizer(s) matching ``optimizer_state``, or ``None``.
        model_state: a full state dict (``None`` to skip the model).
        optimizer_state: plain-format optimizer state (a list for several optimizers), or ``None``.
        full: ``True``: the state is full (plain format). ``False``: it is sharded state from
            ``get_state_dict(full=False)`` of the same world size and wrap policy (to change either, go through
            ``flatshard.save_checkpoint`` / ``load_checkpoint``). Default: ``True``.
        strict: refuse missing or unexpected model keys. Default: ``True``.
    """
    if not full:
        _set_sharded_state_dict(module, optimizer, model_state, optimizer_state, strict=strict)
        return
    optimizers, states = _paired(optimizer, optimizer_state)
    # Validate everything before changing anything.
    if model_state is not None:
        check_full_model_state_dict(module, model_state, strict=strict)
    local = [
        convert_full_optim_state_dict(module, opt, st, source=f"optimizer state #{i}")
        for i, (opt, st) in enumerate(zip(optimizers, states))
    ]
    if model_state is not None:
        load_full_model_state_dict(module, model_state, strict=strict)
    for opt, st in zip(optimizers, local):
        opt.load_state_dict(st)
        after_load(opt)  # see [Note: saving whole-tensor optimizer state]


def optimizer_list(optimizer: OptimizerArg) -> list[torch.optim.Optimizer]:
    """``None``, one optimizer or several, as a list."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _paired(optimizer: OptimizerArg, optimizer_state: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and their states as two lists of equal length (both empty if either is ``None``)."""
    if optimizer is None or optimizer_state is None:
        return [], []
    optimizers = optimizer_list(optimizer)
    states = [optimizer_state] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer_state)
    if len(states) != len(optimizers):
        raise ValueError(f"Got {len(optimizers)} optimizers but {len(states)} optimizer states.")
    return optimizers, states


def _set_sharded_state_dict(
    module: nn.Module,
    optimizer: OptimizerArg,
    model_state: Mapping[str, Any] | None,
    optimizer_state: Any,
    *,
    strict: bool,
) -> None:
    """Load sharded state of this rank's own layout: validate every piece first, then copy."""
    optimizers, states = _paired(optimizer, optimizer_state)
    local_model: dict[str, Any] = {}
    if model_state is not None:
        live = local_param_targets(module)
        own = set(module.state_dict(keep_vars=True))
        missing, unexpected = sorted(own - set(model_state)), sorted(set(model_state) - own)
        if strict and (missing or unexpected):
            raise ValueError(
                f"Sharded state does not match {type(module).__name__}: missing keys {missing[:8]}, unexpected "
                f"keys {unexpected[:8]}. HINT: pass strict=False to skip them (with the Trainer: "
                "self.strict_loading = False in the LightningModule). Nothing was loaded."
            )
        for key, value in model_state.items():
            if key not in live:
                continue
            target = live[key][1]
            if isinstance(value, ParamShard) != (target is not None) or (
                target is not None
                and (value.offset, value.local.numel(), value.shape, value.block)
                != (target.offset, target.local.numel(), target.shape, target.block)
            ):
                raise ValueError(
                    f"Sharded state for {key!r} ({value!r}) does not match this rank's piece ({target!r}). HINT: "
                    "set_state_dict(full=False) takes state of the same world size and wrap policy; to change "
                    "either, save with flatshard.save_checkpoint and load with flatshard.load_checkpoint. "
                    "Nothing was loaded."
                )
        local_model = to_local_model_state(module, model_state)
    local_optim = [
        to_local_optim_state(module, opt, st, source=f"sharded optimizer state #{i}")
        for i, (opt, st) in enumerate(zip(optimizers, states))
    ]
    if model_state is not None:
        with torch.no_grad():
            module.load_state_dict(local_model, strict=False)
    for opt, st in zip(optimizers, local_optim):
        opt.load_state_dict(st)
        after_load(opt)  # see [Note: saving whole-tensor optimizer state]


class FullStates:
    """Full states of sharded modules and of optimizers over them, gathered one unit at a time.

    Built on every rank (collective: the ranks agree on the optimizer states' metadata); :meth:`gather` then moves
    one unit's parameters and optimizer states at a time and hands each gathered tensor, on the keeping rank, to
    ``consume(tensor, target, keys)`` (``target``: its index in ``targets``; ``keys``: the state-dict keys a
    module's tensor goes under, empty for optimizer state), whose result takes the tensor's place in the states
    returned (see [Note: streamed full saves] in ``flatshard.checkpoint.stream_save``). The tensor is dropped
    after ``consume`` returns.

    Args:
        targets: per state, ``(module, None)`` for the module's full state dict or ``(module, optimizer)`` for the
            optimizer's full state in the plain format.
        keep: this rank receives the states (rank 0 of a save).
    """

    def __init__(self, targets: Sequence[tuple[nn.Module, torch.optim.Optimizer | None]], keep: bool) -> None:
        self.keep = keep
        self._plans = [
            plan_full_model_state_dict(module, keep=keep, to_cpu=True)
            if optimizer is None
            else plan_full_optim_state_dict(module, optimizer, keep=keep, to_cpu=True)
            for module, optimizer in targets
        ]

    def gather(self, consume: Callable[[torch.Tensor, int, tuple[str, ...]], Any]) -> list[dict[str, Any]]:
        """Every rank calls; returns the states (empty dicts where not kept), in ``targets`` order."""
        items = [item for plan_items, _ in self._plans for item in plan_items]
        owner = [target for target, (plan_items, _) in enumerate(self._plans) for _ in plan_items]
        results: list[dict[int, Any]] = [{} for _ in items]

        def take(i: int, tensors: dict[int, torch.Tensor]) -> None:
            labels = items[i].labels
            results[i] = {pos: consume(t, owner[i], labels.get(pos, ())) for pos, t in tensors.items()}

        gather_by_unit(items, self.keep, take)
        built = []
        for plan_items, assemble in self._plans:
            built.append(assemble(results[: len(plan_items)]))
            results = results[len(plan_items) :]
        return built
