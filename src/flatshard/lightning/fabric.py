"""``FlatShardFabricStrategy``: ``Fabric(strategy="flatshard")`` on flatshard's engine.

``fabric.setup(model, optimizer)`` shards the model in place; an optimizer may be created before or
after, since the model keeps its Parameter objects (those materialized from the meta device are new, and a
jointly set-up optimizer is pointed at them by name). ``fabric.save`` / ``fabric.load`` write and read one
full checkpoint file (plain model and optimizer state dicts), or with ``state_dict_type="sharded"`` a
directory of per-rank pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from flatshard.checkpoint import (
    ModelState,
    Names,
    OptimizerState,
    gather_for_save,
    is_sharded_checkpoint,
    load_full_entries,
    load_into,
    locate,
    save_full_streamed,
)
from flatshard.engine import (
    clip_grad_norm_params_,
    explaining_step_errors,
    full_model_state_dict,
    full_optim_state_dict,
    is_sharded,
    load_full_model_state_dict,
    no_sync,
    parameter_names,
    rebind_optimizer,
    sharded_model_state_dict,
    sharded_optim_state_dict,
)
from flatshard.lightning.core import ShellMembers
from flatshard.lightning.distributed import barrier, init_process_group, reduce_tensor
from flatshard.lightning.options import OptionArguments, takes_options
from flatshard.lightning.precision import FlatShardFabricHalfPrecision, sharded_scaler
from flatshard.strategy_names import register_names

if TYPE_CHECKING:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment

__all__ = ["FlatShardFabricStrategy"]

log = logging.getLogger(__name__)

_LEFT_OUT = object()  # a state entry whose filter kept nothing: not in the checkpoint (as Fabric does)

_FABRIC_NAMES = "flatshard/fabric"  # which state entries held the module and the optimizers


def _restore_entries(
    state: dict[str, Any], checkpoint: dict[str, Any], skip: Collection[str | None] = ()
) -> None:
    """Move the checkpoint's value of each entry of ``state`` (but those in ``skip``) back: into its
    ``load_state_dict`` if it has one, else into ``state`` under its key."""
    for key, obj in list(state.items()):
        if key in skip or key not in checkpoint:
            continue
        if hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)


def _unwrap(obj: Any) -> Any:
    """Fabric's module / optimizer wrappers -> the objects flatshard manages; anything else as it is (an LR
    scheduler also has an ``optimizer`` attribute and stays a scheduler)."""
    if isinstance(obj, _FabricModule):
        return obj._forward_module
    if isinstance(obj, _FabricOptimizer):
        return obj.optimizer
    return obj


class _NoSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: backward passes keep unsharded gradients (see [Note: no_sync])."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        inner = getattr(module, "_forward_module", module)  # Fabric's wrapper, or the module itself
        if not is_sharded(inner):
            raise TypeError(
                f"no_backward_sync needs the module returned by fabric.setup / setup_module, got "
                f"{type(module).__name__}."
            )
        return no_sync(inner, enabled=enabled)


@takes_options(
    OptionArguments,
    omitted={
        "grad_accumulation": "a Fabric loop chooses per backward with ``fabric.no_backward_sync(model)``."
    },
)
class FlatShardFabricStrategy(ShellMembers, ParallelStrategy):
    """Fabric counterpart of :class:`flatshard.FlatShardStrategy`: the same arguments except
    ``grad_accumulation``. Each argument is described once, beside the option it sets (see [Note: options
    described once]); the list below is generated from those descriptions.

    ``fabric.setup(torch.compile(model))`` compiles each unit's forward as ``compile`` does (see [Note:
    torch.compile]). With ``async_save=True``, :meth:`wait_for_checkpoint` waits for the save in flight.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_io: CheckpointIO | None = None,  # after Lightning's own: positions mirror its FSDPStrategy
        **options: Unpack[OptionArguments],
    ) -> None:
        # Options first: the precision setter, called by the base __init__, checks the flag against them.
        self._take_arguments(FlatShardFabricStrategy, options, process_group_backend, timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._num_nodes = 1
        self._sharded_modules: list[Module] = []
        self._backward_sync_control = _NoSyncControl()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property  # type: ignore[override]
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if type(precision) is FabricMixedPrecision:
            # the inf/NaN check of loss scaling must agree across shards: see [Note: precision flags]
            precision.scaler = sharded_scaler(precision.scaler, precision.device)
        elif type(precision) is FabricHalfPrecision:  # the same, but torchmetrics states are not cast
            precision = FlatShardFabricHalfPrecision(precision.precision)
        elif precision is not None and type(precision) not in (Precision, FlatShardFabricHalfPrecision):
            raise ValueError(
                f"precision={getattr(precision, 'precision', precision)!r} ({type(precision).__name__}) is not "
                "supported with flatshard. HINT: use '32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
            )
        if precision is not None:  # a flag that contradicts mixed_precision fails here, at Fabric(...)
            self._core.check_precision_flag(str(getattr(precision, "precision", "32-true")))
        self._precision = precision

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self._core.launcher(self, _MultiProcessingLauncher, _SubprocessScriptLauncher)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        init_process_group(self)
        self.build_device_mesh()  # fabric.strategy.device_mesh, for the model's plan before fabric.setup

    @override
    def setup_module(self, module: Module) -> Module:
        self._core.setup_module(
            module,
            self.root_device,
            str(getattr(self.precision, "precision", "32-true")),
            self.num_processes,
            self.num_nodes * self.num_processes,
            compile_root=True,  # the module given to fabric.setup, when it is the only unit
            device_mesh=self.device_mesh,
        )
        self._sharded_modules.append(module)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """``fabric.setup(model, optimizer)``: shard the model, then point each optimizer at its parameters.

        Sharding keeps the model's ``Parameter`` objects, except those built on the meta device: materializing
        makes new ones. An optimizer created over the meta model has its references re-acquired by name, so
        ``init_module(empty_init=True)`` followed by a joint setup trains the real parameters.
        """
        names = parameter_names(module)
        module = self.setup_module(module)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, module)
        return module, optimizers, scheduler

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """``empty_init=True`` builds on the meta device; ``setup_module`` materializes unit by unit."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: Module) -> None:
        pass  # shard() places shards and buffers on the root device

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor:
        reduced: Tensor = reduce_tensor(tensor, group, reduce_op)
        return reduced

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_params_(
            self.precision.main_params(optimizer), float(max_norm), float(norm_type), error_if_nonfinite
        )

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        with explaining_step_errors(
            getattr(optimizer, "optimizer", optimizer)
        ):  # an undeclared matrix optimizer
            return super().optimizer_step(optimizer, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _owner(self, optimizer: Optimizer) -> Module:
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for module in self._sharded_modules:
            if any(id(p) in params for p in module.parameters()):
                return module
        raise ValueError("This optimizer's parameters belong to no module set up with this strategy.")

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        if not is_sharded(module):
            return module.state_dict()
        return full_model_state_dict(module, rank0_only=True, to_cpu=True)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if not is_sharded(module):
            module.load_state_dict(state_dict, strict=strict)
            return
        load_full_model_state_dict(module, state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return full_optim_state_dict(self._owner(optimizer), optimizer, rank0_only=True, to_cpu=True)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        self._core.refuse_storage_options(storage_options, "FlatShardFabricStrategy")
        if self.options.state_dict_type == "sharded":
            if filter:
                raise ValueError(
                    "fabric.save(..., filter=...) is not supported with state_dict_type='sharded' (every rank writes "
                    "its own pieces of the whole state). HINT: save without filter, or use state_dict_type='full'."
                )
            checkpoint, names = self._sharded_checkpoint(state)
            self._core.write(checkpoint, path, names)
            return
        filters = filter or {}
        if self._core.async_saver is None and not any(
            isinstance(state.get(key), Optimizer) for key in filters
        ):  # written as it is gathered: [Note: streamed full saves]
            entries = {key: self._streamed_entry(obj, filters.get(key)) for key, obj in state.items()}
            save_full_streamed(path, {key: e for key, e in entries.items() if e is not _LEFT_OUT})
            self.barrier()
            return
        with gather_for_save(locate(path)):  # a rank that dies meanwhile is named on the others
            converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        self._core.write(converted, path)  # rank 0 writes; every rank raises if that failed
        self.barrier()

    def _streamed_entry(self, obj: Any, keep: Callable[[str, Any], bool] | None = None) -> Any:
        """What a ``fabric.save`` state entry becomes in a streamed full save: the full state of a sharded module
        or of an optimizer over one, ``state_dict()`` of any other stateful object, else the value itself.

        ``keep`` is the entry's ``filter``: for a sharded module it selects the tensors as they are gathered;
        otherwise it selects the entries of a dict as Fabric's own save does (the entry is left out where none
        is kept). A filter on an optimizer's state is applied by the non-streamed path."""
        if isinstance(obj, Module) and is_sharded(obj):
            return ModelState(obj, keep)
        if isinstance(obj, Optimizer):
            return OptimizerState(self._owner(obj), obj)
        if isinstance(obj, Module | _Stateful):
            obj = obj.state_dict()
        if keep is None or not isinstance(obj, dict):
            return obj
        kept = {k: v for k, v in obj.items() if keep(k, v)}
        return kept if kept else _LEFT_OUT

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = self.broadcast(path)
        self._core.before_load()
        if is_sharded_checkpoint(path):
            return self._load_sharded(path, state, strict)
        allow_cast = self.options.allow_dtype_kind_cast
        if not state:
            return load_full_entries(path, {}, weights_only=weights_only)
        if isinstance(state, (Module, Optimizer)):
            target = state if isinstance(state, Module) else (state, self._owner(state))
            load_full_entries(
                path,
                {None: target},
                strict=strict,
                weights_only=weights_only,
                allow_dtype_kind_cast=allow_cast,
            )
            return {}
        targets: dict[str | None, Any] = {
            name: (obj, self._owner(obj)) if isinstance(obj, Optimizer) else obj
            for name, obj in state.items()
            if isinstance(obj, (Module, Optimizer))
        }
        checkpoint = load_full_entries(
            path,
            targets,
            strict=strict,
            weights_only=weights_only,
            required=state if strict else (),
            allow_dtype_kind_cast=allow_cast,
        )
        _restore_entries(state, checkpoint)
        return checkpoint

    def wait_for_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (``async_save=True``) and raise its error, naming the path."""
        self._core.wait_for_save()

    @override
    def teardown(self) -> None:
        try:
            self.wait_for_checkpoint()
        finally:
            super().teardown()

    # ------------------------------------------------------------------ sharded checkpoints
    def _split_state(
        self, state: Module | Optimizer | dict[str, Any] | None
    ) -> tuple[str | None, Module | None, list[tuple[str, Optimizer]]]:
        """The one sharded module in ``state`` (its name and object) and the optimizers, in ``state`` order."""
        if isinstance(state, Module):
            return None, state, []
        if not isinstance(state, dict):
            raise TypeError(
                f"A sharded checkpoint is loaded into a module or a dict of state, got {type(state).__name__}."
            )
        modules = [(k, v) for k, v in state.items() if isinstance(v, Module) and is_sharded(_unwrap(v))]
        if len(modules) != 1:
            raise ValueError(
                f"state_dict_type='sharded' saves and loads exactly one sharded module per checkpoint; the state has "
                f"{len(modules)} ({', '.join(k for k, _ in modules) or 'none'}). HINT: put one model in the state, "
                "or use state_dict_type='full'."
            )
        optimizers = [(k, _unwrap(v)) for k, v in state.items() if isinstance(_unwrap(v), Optimizer)]
        return modules[0][0], _unwrap(modules[0][1]), optimizers  # type: ignore[return-value]

    def _sharded_checkpoint(self, state: dict[str, Any]) -> tuple[dict[str, Any], Names]:
        """The state as the sharded format stores it, and the names it is stored under (the state's own, as
        Lightning's Fabric strategies store them; see [Note: DCP-native layout])."""
        name, module, optimizers = self._split_state(state)
        assert module is not None
        names = [n for n, _ in optimizers]
        extra = {
            k: (v.state_dict() if hasattr(v, "state_dict") else v)
            for k, v in state.items()
            if k != name and k not in names
        }
        checkpoint = {
            "state_dict": sharded_model_state_dict(module),
            "optimizer_states": [sharded_optim_state_dict(module, opt) for _, opt in optimizers],
            _FABRIC_NAMES: {"module": name, "optimizers": names},
            **extra,
        }
        return checkpoint, Names(name or "model", tuple(names))

    def _load_sharded(self, path: Any, state: Any, strict: bool) -> dict[str, Any]:
        name, module, optimizers = self._split_state(state)
        assert module is not None
        handled = {name, *(n for n, _ in optimizers)}  # entries load_into fills
        others = [k for k in state if k not in handled] if isinstance(state, dict) else []
        rest = load_into(
            path,
            module,
            [opt for _, opt in optimizers],
            strict=strict,
            load_optimizer_states=bool(optimizers),
            required=others if strict else (),  # checked before anything changes
            names=Names(name or "model", tuple(n for n, _ in optimizers)),
            allow_dtype_kind_cast=self.options.allow_dtype_kind_cast,
        )
        saved = rest.pop(_FABRIC_NAMES, {})
        if optimizers and saved.get("optimizers") not in (None, [n for n, _ in optimizers]):
            log.warning(
                "flatshard: optimizers were saved as %s and loaded into %s, matched by position.",
                saved.get("optimizers"),
                [n for n, _ in optimizers],
            )
        if isinstance(state, dict):
            _restore_entries(state, rest, skip=handled)
        return rest

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)
