"""Optimizers and sharded parameters: an optimizer built before ``shard()`` pointed at the sharded module,
and original shapes (without values) for a ``configure_optimizers`` that runs after sharding.

See [Note: configure_optimizers sees the original shapes] in ``flatshard.lightning.strategy``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.handle import locate_params
from flatshard.engine.runtime import unit_states
from flatshard.engine.state.full_optim import optimizer_params
from flatshard.engine.step.optimizer_offload import offload_plan

__all__ = ["original_shapes", "rebind_optimizer"]


@contextmanager
def original_shapes(module: nn.Module) -> Iterator[None]:
    """Inside, every sharded parameter of ``module`` has its original shape (not its 1-D piece) and no values:
    its data is one element repeated by zero strides. For building an optimizer whose param groups depend
    on shapes after the model is sharded; ``rebind_optimizer`` then cuts any state it made to the pieces.
    """
    scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for handle in (h for state in unit_states(module) for h in state.handles):
            if handle.shard_world == 1:
                continue  # its pieces already have the full shapes
            for p, shape in zip(handle.params, handle.layout.shapes, strict=True):
                one = scratch.setdefault((p.dtype, p.device), torch.zeros(1, dtype=p.dtype, device=p.device))
                saved.append((p, p.data))
                p.data = one.as_strided(shape, (0,) * len(shape))
        yield
    finally:
        for p, data in saved:
            p.data = data


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str], module: nn.Module) -> None:
    """Fit an optimizer built before ``shard()`` to the sharded module.

    ``shard()`` keeps a module's ``Parameter`` objects, except those built on the meta device: materializing
    makes new ones. Each parameter the optimizer holds that was the module's (``names``, taken before
    sharding) and no longer is, is replaced by the module's parameter of the same name. State an optimizer
    created in its constructor (Adagrad's ``sum``) has the parameter's full shape; it is cut down to this
    rank's piece. Tensors that were never the module's are left alone. Raises ``ValueError`` (changing
    nothing) if a parameter cannot be found, or holds state although it was replaced. An optimizer over units
    with ``cpu_offload="optimizer"`` gets its load hooks here (see [Note: optimizer offload]).
    """
    now = dict(module.named_parameters(remove_duplicate=True))
    current = {id(p) for p in now.values()}
    replace: list[tuple[dict[str, Any], int, torch.Tensor, nn.Parameter]] = []
    for index, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in current or id(p) not in names:
                continue
            name = names[id(p)]
            if name not in now:
                raise ValueError(
                    f"{type(optimizer).__name__} param group {index} holds parameter {name!r}, which the model no "
                    "longer has after sharding. HINT: create the optimizer after sharding the model."
                )
            if optimizer.state.get(p):
                raise ValueError(
                    f"{type(optimizer).__name__} already holds state for parameter {name!r}, which sharding "
                    "replaced (it was built on the meta device). HINT: create the optimizer after sharding."
                )
            replace.append((group, i, p, now[name]))
    for group, i, old, new in replace:
        optimizer.state.pop(old, None)
        params = list(group["params"])
        params[i] = new
        group["params"] = params
    params = optimizer_params(optimizer)
    for p, (handle, index) in zip(params, locate_params(params), strict=True):
        if handle is None or not optimizer.state.get(p):
            continue
        full_shape, info = handle.layout.shapes[index], handle.shard_infos[index]
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor) and value.shape == full_shape and value.shape != p.shape:
                start = info.offset_in_param
                piece = value.reshape(-1)[start : start + info.numel_in_shard]
                optimizer.state[p][key] = piece.to(p.device).clone().view(p.shape)
    offload_plan(optimizer)
