"""Full ("consolidated") model state: gathered unit by unit, loaded slice by slice.

A full state dict has exactly the keys, shapes and dtypes of the plain module's ``state_dict()``
(tied parameters appear under each of their names), so it loads into the unsharded module with
``load_state_dict(strict=True)`` and into a sharded one of any world size or wrap policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.handle import FlatParamHandle, handle_of_param
from flatshard.engine.precision import original_buffer_dtypes
from flatshard.engine.runtime import Summoned, TrainingState, UnitState, raise_if_unfilled, unit_states
from flatshard.engine.state.stand_ins import saved_piece, saved_value, stand_in
from flatshard.engine.state.stream_gather import GatherItem, gather_items
from flatshard.engine.transport import comm

__all__ = [
    "check_full_model_state_dict",
    "full_model_state_dict",
    "gather_full_flat",
    "load_full_model_state_dict",
    "parameter_names",
    "plan_full_model_state_dict",
    "prepare_for_state_io",
]


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of the module's parameters; a shared parameter gets its first name."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


def prepare_for_state_io(module: nn.Module, what: str, reading: bool = False) -> list[UnitState]:
    """Reshard every unit (so modules hold their original Parameters); refuse inside forward/backward.

    ``reading``: the caller only reads state from the shards (:func:`~flatshard.engine.state.stand_ins.live_piece`),
    which is allowed inside ``unshard_params`` too; units there are left as they are.
    """
    states = unit_states(module)
    if not states:
        raise ValueError(
            f"{what}: {type(module).__name__} is not sharded. HINT: call flatshard.shard() first."
        )
    for s in states:
        if s.summoned is not Summoned.NO and not reading:
            raise RuntimeError(
                f"{what} was called inside flatshard.unshard_params of {type(s.module).__name__}. HINT: call it "
                "after leaving the unshard_params context."
            )
        if s.training_state is not TrainingState.IDLE or s.forward_depth:
            raise RuntimeError(
                f"{what} was called during the forward or backward of {type(s.module).__name__} "
                f"(state {s.training_state.value}). HINT: call it between training steps."
            )
    if reading:  # a save of values nothing gave: see [Note: unfilled tensors]
        raise_if_unfilled(states, f"{what} was called (to save the model)")
    for s in states:
        if s.summoned is Summoned.NO:
            for handle in s.handles:
                handle.reshard()
    return states


def gather_full_flat(handle: FlatParamHandle) -> torch.Tensor:
    """The unit's whole flat parameter (padded), gathered into a new buffer (the shard itself on 1 rank),
    on the compute device."""
    if handle.shard_world == 1:
        return handle.sharded
    full = torch.empty(handle.layout.padded_numel, dtype=handle.dtype, device=handle.device)
    comm.all_gather_flat(full, handle.sharded.to(handle.device), handle.shard_group, async_op=False)
    return full


_PACKED_QUANTIZED = tuple(getattr(torch, n) for n in ("quint4x2", "quint2x4") if hasattr(torch, n))


def copy_out(t: torch.Tensor, to_cpu: bool) -> torch.Tensor:
    t = t.detach()
    if t.dtype in _PACKED_QUANTIZED and t.qscheme() == torch.per_tensor_affine:
        # torch has no copy kernel for the packed quantized dtypes (they live on the CPU): copy their bytes
        copy = torch._empty_affine_quantized(
            t.shape, scale=t.q_scale(), zero_point=t.q_zero_point(), dtype=t.dtype
        )
        copy.untyped_storage().copy_(t.contiguous().untyped_storage())
        return copy
    return t.to("cpu", copy=True) if to_cpu else t.clone()


def full_model_state_dict(
    module: nn.Module, *, rank0_only: bool = True, to_cpu: bool = True
) -> dict[str, Any]:
    """Gather the full model state; with ``rank0_only`` other ranks return ``{}``. Must run on all ranks.

    Each unit's shards move straight into the returned full-shape tensors (see [Note: streamed
    full-state gathers]); no rank ever holds a unit's flat parameter unsharded.
    """
    keep = comm.global_rank() == 0 or not rank0_only
    items, assemble = plan_full_model_state_dict(module, keep=keep, to_cpu=to_cpu)
    return assemble(gather_items(items, keep))


def plan_full_model_state_dict(
    module: nn.Module, *, keep: bool, to_cpu: bool
) -> tuple[list[GatherItem], Callable[[list[dict[int, torch.Tensor]]], dict[str, Any]]]:
    """What to gather (one item per unit) and how to build the state dict from the gathered tensors.

    Split so that a caller gathering model and optimizer state moves everything in one
    :func:`~flatshard.engine.state.stream_gather.gather_items` call.
    """
    states = prepare_for_state_io(module, "get_state_dict", reading=True)
    handles = [h for s in states for h in s.handles]
    keys: dict[int, list[str]] = {}  # id(parameter) -> its state-dict keys (a tied weight has several)
    for key, value in module.state_dict(keep_vars=True).items():
        keys.setdefault(id(value), []).append(key)
    items = [
        GatherItem(
            group=h.shard_group,
            device=h.device,  # collectives run on the compute device; offloaded shards are staged there
            layout=h.layout,
            dtype=h.dtype,
            wanted=list(range(len(h.params))),
            pieces=_saved_pieces(h),
            out_device=torch.device("cpu") if to_cpu else h.sharded.device,
            labels={i: tuple(keys.get(id(p), ())) for i, p in enumerate(h.params)},
            tensor_parallel=h.tensor_parallel_of(range(len(h.params))),
        )
        for h in handles
    ]

    def assemble(results: list[dict[int, torch.Tensor]]) -> dict[str, Any]:
        if not keep:
            return {}
        gathered: dict[int, torch.Tensor] = {}
        for h, tensors in zip(handles, results, strict=True):
            for i, p in enumerate(h.params):
                gathered[id(p)] = tensors[i]
        out: dict[str, Any] = {}
        restore = original_buffer_dtypes(module)
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) in gathered:
                out[key] = gathered[id(value)]
            elif isinstance(value, torch.Tensor):
                out[key] = copy_out(saved_piece(value), to_cpu).to(restore.get(key, value.dtype))
            else:
                out[key] = value
        return out

    return items, assemble


def _saved_pieces(h: FlatParamHandle) -> list[tuple[int, torch.Tensor]]:
    """This rank's shard of ``h`` as the state functions read it: the shard itself, or, where parameters have
    stand-ins (see [Note: stand-ins]), each parameter's piece at its offset (padding arrives as zeros)."""
    if all(stand_in(p) is None for p in h.params):
        return [(0, h.sharded.detach())]
    return [
        (info.offset_in_shard, saved_value(p, h.piece(i)).reshape(-1))
        for i, (p, info) in enumerate(zip(h.params, h.shard_infos, strict=True))
        if info.numel_in_shard
    ]


def _expected_shapes(module: nn.Module) -> dict[str, tuple[torch.Size, FlatParamHandle | None, int]]:
    """state-dict key -> (full shape, managing handle or None, index in the handle)."""
    out: dict[str, tuple[torch.Size, FlatParamHandle | None, int]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        handle = handle_of_param(value)
        if handle is None:
            out[key] = (value.shape, None, -1)
        else:
            idx = handle.index_of(value)
            out[key] = (handle.full_shape(idx), handle, idx)
    return out


def check_full_model_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, source: str = "state_dict"
) -> dict[str, tuple[torch.Size, FlatParamHandle | None, int]]:
    """Raise if ``state_dict`` does not fit ``module`` (keys, shapes); changes nothing.

    Returns the key -> (full shape, handle, index) map it checked against, for the loader to reuse.
    """
    prepare_for_state_io(module, "set_state_dict")
    expected = _expected_shapes(module)
    own_keys = set(module.state_dict(keep_vars=True).keys())
    missing = sorted(own_keys - set(state_dict))
    unexpected = sorted(set(state_dict) - own_keys)
    problems = []
    if strict and missing:
        problems.append(f"missing keys {_short(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    shapes = [
        f"{key!r} has shape {tuple(value.shape)} in {source} but {tuple(shape)} in the model"
        for key, (shape, _, _) in expected.items()
        if isinstance(value := state_dict.get(key), torch.Tensor) and value.shape != shape
    ]
    problems += shapes[:5]
    if len(shapes) > 5:
        problems.append(f"{len(shapes) - 5} more parameters of another shape ({len(shapes)} in all)")
    if problems:
        raise ValueError(
            f"{source} does not match {type(module).__name__}: "
            + "; ".join(problems)
            + ". HINT: load a checkpoint of the same model architecture, or pass strict=False to skip missing "
            "and unexpected keys (with the Trainer: self.strict_loading = False in the LightningModule). Nothing "
            "was loaded."
        )
    return expected


def load_full_model_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    source: str = "state_dict",
    after_copy: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Load a full state dict; each rank copies only its own slices. Validates everything first.

    ``after_copy`` is called with each slice read once it is copied (the loader of a memory-mapped file gives
    its pages back there: see [Note: reading a full file by byte ranges]).
    """
    expected = check_full_model_state_dict(module, state_dict, strict=strict, source=source)
    rest: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in state_dict.items():
            entry = expected.get(key)
            if entry is None or entry[1] is None:
                rest[key] = value
                continue
            _, handle, idx = entry
            assert handle is not None
            info = handle.shard_infos[idx]
            handle.mark_filled(idx)
            if info.numel_in_shard:
                value = handle.local_of_full(idx, value)  # see [Note: tensor parallelism]
                src = value.reshape(-1)[info.offset_in_param : info.offset_in_param + info.numel_in_shard]
                handle.sharded[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].copy_(src)
                if after_copy is not None:
                    after_copy(src)
    if rest:
        module.load_state_dict(rest, strict=False)
        if after_copy is not None:
            for value in rest.values():
                if isinstance(value, torch.Tensor):
                    after_copy(value)


def _short(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} total)"
