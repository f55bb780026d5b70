"""Strategy arguments, validated once and shared by the Trainer and Fabric strategies.

The sharding options are the engine's :class:`~flatshard.engine.ShardOptions`, embedded as they are; this
record adds what only a strategy has (checkpoint format, launcher, accumulation mode, hybrid layout by
node). Every argument is checked once, and one error lists every bad one, each named with a hint; no
argument is ever silently ignored.

A strategy hands its ``__init__`` arguments over as they are (:meth:`StrategyOptions.from_arguments`), so
adding an option touches :class:`~flatshard.engine.ShardOptions`, the two strategy signatures (explicit, for
LightningCLI) and the docs, nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from flatshard.engine import MixedPrecision, OptionErrors, ShardOptions, compile_kwargs

__all__ = ["StrategyOptions"]

_STATE_DICT_TYPES = ("full", "sharded")
_START_METHODS = ("popen", "spawn")
_GRAD_ACCUMULATION = ("sharded", "no_sync")
_HYBRID_LAYOUT = ("shard_group_size", "process_group", "device_mesh")


def _one_of(name: str, value: object, choices: tuple[str, ...], hint: str = "") -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}.{' HINT: ' + hint if hint else ''}")
    return value  # type: ignore[return-value]


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r} ({type(value).__name__}). HINT: pass a bool."
        )


def _check_async_save(value: object, state_dict_type: object) -> None:
    _check_flag("async_save", value)
    if value and state_dict_type == "full":
        raise ValueError(
            "async_save=True needs state_dict_type='sharded': a full save spends its time gathering the state "
            "onto rank 0, a collective that cannot run in the background. HINT: set state_dict_type='sharded' "
            "(`flatshard consolidate DIR OUT.ckpt` makes a full file from a directory later), or async_save=False."
        )


def _check_device_mesh(value: object) -> Any:
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
        ):
            raise ValueError(
                f"device_mesh={value!r} must be (replicas, ranks per shard group), two positive ints."
            )
        return tuple(value)
    if value is not None and type(value).__name__ != "DeviceMesh":
        raise TypeError(
            f"device_mesh must be a (replicas, shard group size) tuple or a 2-D DeviceMesh, got {type(value).__name__}."
        )
    return value


def _check_hybrid_layout(shard: ShardOptions, device_mesh: Any) -> None:
    given = [
        name
        for name, value in zip(_HYBRID_LAYOUT, (shard.shard_group_size, shard.process_group, device_mesh))
        if value is not None
    ]
    if given and not shard.sharding_strategy.is_hybrid:
        raise ValueError(
            f"{', '.join(given)} only apply to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {shard.sharding_strategy.name}. "
            "HINT: set sharding_strategy='HYBRID_SHARD', or drop them."
        )
    if len(given) > 1:
        raise ValueError(f"Give one of shard_group_size, process_group, device_mesh, not {', '.join(given)}.")
    group = shard.process_group
    if group is not None and not (isinstance(group, tuple) and len(group) == 2):
        raise TypeError(
            f"process_group must be a (shard_group, replicate_group) tuple, got {type(group).__name__}."
        )


@dataclass(frozen=True)
class StrategyOptions:
    """A strategy's options: the engine's :class:`ShardOptions` plus what only a strategy has."""

    shard: ShardOptions = field(default_factory=ShardOptions)
    state_dict_type: str = "full"
    start_method: str = "popen"
    grad_accumulation: str = "sharded"
    device_mesh: Any = None  # hybrid: (replicas, ranks per shard group) or a 2-D DeviceMesh
    compile: Any = False  # False / True / torch.compile kwargs; after validation: None (off) or the kwargs
    async_save: bool = (
        False  # sharded saves written in the background (see [Note: asynchronous sharded saves])
    )
    allow_dtype_kind_cast: bool = False  # loading casts integer / bool / floating point across kinds

    def __post_init__(self) -> None:
        errors = OptionErrors("flatshard strategy")
        errors.check(_one_of, "state_dict_type", self.state_dict_type, _STATE_DICT_TYPES)
        errors.check(_one_of, "start_method", self.start_method, _START_METHODS)
        errors.check(_check_async_save, self.async_save, self.state_dict_type)
        errors.check(_check_flag, "allow_dtype_kind_cast", self.allow_dtype_kind_cast)
        errors.check(
            _one_of,
            "grad_accumulation",
            self.grad_accumulation,
            _GRAD_ACCUMULATION,
            "'sharded' reduce-scatters every micro-batch (least memory), 'no_sync' reduces once per optimizer step.",
        )
        mesh = errors.check(_check_device_mesh, self.device_mesh)
        errors.check(_check_hybrid_layout, self.shard, mesh)
        compile_kwargs_ = errors.check(compile_kwargs, self.compile)  # see [Note: torch.compile]
        errors.raise_if_any()
        object.__setattr__(self, "device_mesh", mesh)
        object.__setattr__(self, "compile", compile_kwargs_)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> StrategyOptions:
        """Options from a strategy's ``__init__`` arguments (``locals()``): every :class:`ShardOptions` field
        and every field of this record found there; other names (the accelerator, ...) are not options.

        All of them are validated together: one error lists every bad argument.
        """
        errors = OptionErrors("flatshard strategy")
        shard_args = {k: arguments[k] for k in ShardOptions.field_names() if k in arguments}
        own = {f.name: arguments[f.name] for f in fields(cls) if f.name != "shard" and f.name in arguments}
        shard = errors.check(lambda: ShardOptions(**shard_args))
        # Without valid sharding options, this record's own fields are still checked (against the defaults).
        options = errors.check(lambda: cls(**own) if shard is None else cls(shard=shard, **own))
        errors.raise_if_any()
        assert options is not None
        return options

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return self.shard.mixed_precision

    def shard_options(
        self,
        device: torch.device,
        precision: MixedPrecision | None = None,
        ranks_per_node: int = 1,
        world_size: int = 1,
    ) -> ShardOptions:
        """The options ``shard()`` gets on ``device``; ``precision`` is the engine's config for the precision
        flag (``mixed_precision_for``, which also honours and checks an explicit ``mixed_precision``). Hybrid
        strategies shard within a node (``ranks_per_node``) unless the groups were given."""
        return replace(
            self.shard, device=device, mixed_precision=precision, **self._groups(ranks_per_node, world_size)
        )

    def _groups(self, ranks_per_node: int, world_size: int) -> dict[str, Any]:
        shard = self.shard
        if not shard.sharding_strategy.is_hybrid or shard.process_group is not None:
            return {}
        if isinstance(self.device_mesh, tuple):
            replicas, size = self.device_mesh
            if replicas * size != world_size:
                raise ValueError(
                    f"device_mesh={self.device_mesh} has {replicas * size} ranks but the world has {world_size}. "
                    f"HINT: (replicas, ranks per shard group) must multiply to {world_size}."
                )
            return {"shard_group_size": size}
        if self.device_mesh is not None:
            return {"process_group": self.device_mesh}
        return {"shard_group_size": shard.shard_group_size or ranks_per_node}
