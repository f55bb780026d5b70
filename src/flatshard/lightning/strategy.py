"""``FlatShardStrategy``: Lightning's Trainer driving flatshard's sharding engine.

The LightningModule is sharded in place (no wrapper): ``trainer.model is lightning_module``. Step
methods are routed through the module's ``forward`` (Lightning's forward redirection) so the root
unit's hooks gather and free its parameters around ``training_step`` and friends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import Unpack, override

from flatshard.checkpoint import (
    ModelState,
    Names,
    OptimizerState,
    gather_for_save,
    load_into,
    save_full_streamed,
)
from flatshard.engine import (
    ShardingStrategy,
    explaining_step_errors,
    full_model_state_dict,
    full_optim_state_dict,
    is_sharded,
    no_sync,
    original_shapes,
    parameter_names,
    rebind_optimizer,
    set_requires_all_reduce,
    sharded_model_state_dict,
    sharded_optim_state_dict,
)
from flatshard.lightning.core import ShellMembers
from flatshard.lightning.distributed import (
    barrier,
    init_process_group,
    reduce_tensor,
    set_world_ranks,
)
from flatshard.lightning.launcher import SpawnLauncher
from flatshard.lightning.options import TrainerOptionArguments, takes_options
from flatshard.lightning.precision import FlatShardPrecision, to_flatshard_precision
from flatshard.lightning.step_modes import StepModes
from flatshard.lightning.streamed_saves import TrainerSaves, hook_reading_state
from flatshard.lightning.summary import count_full_parameters
from flatshard.strategy_names import register_names

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

log = logging.getLogger(__name__)

__all__ = ["FlatShardStrategy"]


@takes_options(TrainerOptionArguments)
class FlatShardStrategy(ShellMembers, ParallelStrategy):
    r"""Fully sharded data-parallel training with flatshard's engine.

    Arguments mirror Lightning's ``FSDPStrategy`` so that migrating is a one-word change. Each argument is
    described once, beside the option it sets (see [Note: options described once]); the list below is
    generated from those descriptions.
    """

    strategy_name = "flatshard"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Unpack[TrainerOptionArguments],
    ) -> None:
        # Options first: the precision setter, called by the base __init__, checks the flag against them.
        self._take_arguments(FlatShardStrategy, options, process_group_backend, timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._step_modes = StepModes()
        self._trainer_saves = TrainerSaves()  # see [Note: streamed Trainer saves]

    # ------------------------------------------------------------------ properties
    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.options.shard.sharding_strategy

    @property
    def is_distributed(self) -> bool:  # read by Lightning to add a DistributedSampler
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # state is loaded into the already sharded model, slice by slice

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores optimizers itself (full state -> local slices)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> FlatShardPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, FlatShardPrecision) else FlatShardPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        plugin = to_flatshard_precision(precision_plugin)
        if plugin is not None:  # a flag that contradicts mixed_precision fails here, at Trainer(...)
            self._core.check_precision_flag(plugin.precision)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        init_process_group(self)
        if self.build_device_mesh() is not None:  # configure_model reads it as self.device_mesh
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self.device_mesh

    def set_world_ranks(self) -> None:  # called by Lightning's connector when the Trainer is built
        set_world_ranks(self)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self._core.launcher(self, SpawnLauncher, _SubprocessScriptLauncher)

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._trainer_saves.watch(trainer)  # see [Note: streamed Trainer saves]
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        # [Note: configure_optimizers sees the original shapes]
        # Between steps a sharded parameter's data is a 1-D piece of its unit's shard, so a
        # configure_optimizers that groups by shape (no weight decay where p.ndim < 2, as most GPT recipes do)
        # would put matrices in the wrong group and train differently from DDP, silently. So the optimizers are
        # built before sharding, on the parameters as the user made them (full shapes and values, or meta
        # tensors). Sharding keeps the Parameter objects; those materialized from the meta device are new and
        # the optimizers are pointed at them by name. State an optimizer makes in its constructor (Adagrad's
        # sum) is cut down to each rank's piece. Where the model is sharded already (a second fit, or fit after
        # validate), or such state was made for meta parameters, configure_optimizers runs on the sharded
        # model inside original_shapes(): the right shapes, without values.
        early = fitting and not is_sharded(self.model)
        names = parameter_names(self.model) if early else {}
        if early:
            self.setup_optimizers(trainer)
        self.model = self._core.setup_module(
            self.model,
            self.root_device,
            self.precision_plugin.precision,
            self.num_processes,
            self.num_nodes * self.num_processes,
            compile_root=False,  # the LightningModule's forward runs the steps
            device_mesh=self.device_mesh,
        )
        count_full_parameters(trainer)  # ModelSummary shows the model's sizes, not this rank's shards
        self.barrier()
        if early:
            try:
                for optimizer in self.optimizers:
                    rebind_optimizer(optimizer, names, self.model)
            except ValueError as err:
                log.info("flatshard: %s configure_optimizers runs again, on the sharded model.", err)
                early = False
        if fitting and not early:
            with original_shapes(self.model):
                self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                rebind_optimizer(optimizer, {}, self.model)
        self.setup_precision_plugin()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this around accumulating micro-batches; see ``grad_accumulation``."""
        if self.model is None or not is_sharded(self.model):
            yield
        elif self.options.grad_accumulation == "no_sync":
            with no_sync(self.model):
                yield
        else:  # "sharded": under hybrid sharding the reduction across replicas waits for the last micro-batch
            set_requires_all_reduce(self.model, False)
            try:
                yield
            finally:
                set_requires_all_reduce(self.model, True)

    @override
    def model_to_device(self) -> None:
        pass  # shard() places shards and buffers on the root device

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init: build on the meta device; shard() materializes one unit at a time (reset_parameters()
        # or param_init_fn), so the whole model never exists unsharded.
        with (
            torch.device("meta") if empty_init else nullcontext(),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    # ------------------------------------------------------------------ steps through forward
    def _through_forward(
        self, method: str, context: AbstractContextManager[Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Call ``lightning_module.<method>`` as the module's forward, so the root unit's hooks run.

        Under autocast the step's arguments (the batch: inputs, targets, masks) keep their dtypes, as under
        DDP, instead of being cast like a unit's forward inputs; see [Note: mixed precision].
        """
        assert self.model is not None and self.lightning_module is not None
        model, module = self.model, self.lightning_module

        def step() -> Any:
            with context:
                return self._forward_redirection(model, module, method, *args, **kwargs)

        return self._step_modes.run(
            model,
            method,
            step,
            autocast=self.precision_plugin.autocast,
            manual_optimization=not module.automatic_optimization,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_forward(
            "training_step", self.precision_plugin.train_step_context(), *args, **kwargs
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "validation_step", self.precision_plugin.val_step_context(), *args, **kwargs
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(
            "predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs
        )

    def _evaluation_step(
        self, method: str, context: AbstractContextManager[Any], *args: Any, **kwargs: Any
    ) -> Any:
        """An evaluation step, then (after this rank's last batch) serving the others: see [Note: joining
        uneven evaluation loops]."""
        try:
            out = self._through_forward(method, context, *args, **kwargs)
        except BaseException:
            self._step_modes.end_evaluation(serve=False)
            raise
        loop = self.lightning_module.trainer._active_loop if self.lightning_module is not None else None
        progress = getattr(loop, "batch_progress", None)
        self._step_modes.after_evaluation_step(bool(getattr(progress, "is_last_batch", False)))
        return out

    # ------------------------------------------------------------------ evaluation loops (joined)
    @override
    def on_validation_start(self) -> None:
        self._step_modes.begin_evaluation(self.model)

    @override
    def on_test_start(self) -> None:
        self._step_modes.begin_evaluation(self.model)

    @override
    def on_predict_start(self) -> None:
        self._step_modes.begin_evaluation(self.model)

    @override
    def on_validation_end(self) -> None:
        self._step_modes.end_evaluation()

    @override
    def on_test_end(self) -> None:
        self._step_modes.end_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._step_modes.end_evaluation()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._step_modes.end_evaluation(serve=False)
        self._core.abandon_save()  # a save whose peers may never finish: do not wait for it

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        with explaining_step_errors(optimizer):  # a matrix optimizer not declared: say how
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._step_modes.after_optimizer_step(self.model)  # a step inside training_step (manual optimization)
        return out

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._step_modes.before_backward(
            self.model, closure_loss
        )  # manual optimization: inside training_step

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor:
        reduced: Tensor = reduce_tensor(tensor, group, reduce_op)
        return reduced

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        if self.options.state_dict_type == "sharded":
            return sharded_model_state_dict(self.model)  # views of this rank's pieces, no communication
        if self._streams_this_save():  # written as it is gathered: see [Note: streamed Trainer saves]
            return ModelState(self.model)  # type: ignore[return-value]
        with gather_for_save():  # a rank that dies meanwhile is named on the others
            return full_model_state_dict(self.model, rank0_only=True, to_cpu=True)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.options.state_dict_type == "sharded":
            return sharded_optim_state_dict(self.model, optimizer)
        if self._streams_this_save():
            return OptimizerState(self.model, optimizer)  # type: ignore[return-value]
        with gather_for_save():
            return full_optim_state_dict(self.model, optimizer, rank0_only=True, to_cpu=True)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint, before Lightning restores the rest

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a full file from rank 0, or (``state_dict_type="sharded"``) a directory from every rank; a
        local path or an fsspec URL (see [Note: checkpoint storage])."""
        self._core.refuse_storage_options(storage_options, "FlatShardStrategy")
        if _has_placeholders(checkpoint):  # see [Note: streamed Trainer saves]
            save_full_streamed(filepath, checkpoint)
            return
        # a 2-D run writes the model where Lightning's ModelParallelStrategy reads it, else where its FSDPStrategy
        # does (see [Note: DCP-native layout]); flatshard reads either
        self._core.write(checkpoint, filepath, Names("state_dict") if self.device_mesh is not None else None)

    def _streams_this_save(self) -> bool:
        """Whether the full state asked for now goes into a checkpoint that ``save_checkpoint`` streams."""
        if self._core.async_saver is not None or not self._trainer_saves.active:
            return False
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None:
            return False
        hook = hook_reading_state(trainer)
        if hook is not None:
            self._trainer_saves.report_not_streamed(hook)
            return False
        return True

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._core.remove(filepath, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a full file or a sharded directory (any world size): model and optimizers, validated first.

        Returns the rest of the checkpoint for Lightning to restore loops, callbacks and schedulers.
        """
        path = self.broadcast(checkpoint_path)
        self._core.before_load()
        assert self.model is not None and self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return load_into(
            path,
            self.model,
            list(self.optimizers) if fitting else [],
            strict=self.lightning_module.strict_loading,
            load_optimizer_states=fitting,
            weights_only=weights_only,
            allow_dtype_kind_cast=self.options.allow_dtype_kind_cast,
        )

    # ------------------------------------------------------------------ teardown / registry
    @override
    def teardown(self) -> None:
        try:
            self._core.wait_for_save()  # the last save is complete (or its error raised) when fit returns
        finally:
            self._teardown()

    def _teardown(self) -> None:
        pl_module = self.lightning_module
        if (
            pl_module is not None
            and pl_module._trainer is not None
            and pl_module._trainer.state.fn == TrainerFn.FITTING
            and self._layer_sync
        ):
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)


def _has_placeholders(checkpoint: Mapping[str, Any]) -> bool:
    state = checkpoint.get("state_dict")
    optimizers = checkpoint.get("optimizer_states")
    return isinstance(state, ModelState) or (
        isinstance(optimizers, list) and any(isinstance(o, OptimizerState) for o in optimizers)
    )
