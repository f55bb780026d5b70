"""What the Trainer and Fabric strategies do the same way, once: the model's setup, checkpoint writes, loads'
waiting, the launcher, the asynchronous saver's life.

[Note: one core, two shells]
Lightning has two strategy APIs (``lightning.pytorch`` for the Trainer, ``lightning.fabric`` for Fabric) with
different method names and call orders, but what flatshard does in them is the same. :class:`StrategyCore`
holds it: a shell (``FlatShardStrategy``, ``FlatShardFabricStrategy``) adapts one API to it and keeps only
what that API alone has (the Trainer's step routing and evaluation joins, Fabric's state dicts of named
objects). Every save and load goes through ``flatshard.checkpoint``'s public functions, so a damaged file or
a failing rank gives the same error on every rank in both. What Lightning reads from a strategy the same way
in both APIs (the root device, the sampler's ranks, broadcasts) a shell inherits from :class:`ShellMembers`;
the arguments each API hands a strategy (``precision_plugin`` or ``precision``) stay in the shell's
signature, and the options after them are declared once (see [Note: options described once]).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from flatshard.checkpoint import (
    AsyncSaver,
    Names,
    remove_checkpoint,
    write_full_checkpoint,
    write_sharded_checkpoint,
)
from flatshard.engine import compile_units, is_sharded, register_generate, shard
from flatshard.lightning.distributed import broadcast_object
from flatshard.lightning.metrics import move_metrics
from flatshard.lightning.options import StrategyOptions
from flatshard.lightning.precision import mixed_precision_for

__all__ = ["ShellMembers", "StrategyCore"]

log = logging.getLogger(__name__)


class StrategyCore:
    """One strategy's options and the work both shells share (see [Note: one core, two shells])."""

    def __init__(self, options: StrategyOptions) -> None:
        self.options = options
        self.async_saver = AsyncSaver() if options.async_save else None

    # ------------------------------------------------------------------ model setup
    def setup_module(
        self,
        module: Module,
        device: torch.device,
        precision_flag: str,
        ranks_per_node: int,
        world_size: int,
        compile_root: bool,
        device_mesh: Any | None = None,
    ) -> Module:
        """Shard ``module`` in place (unless it is already), compile its units (the module itself too where
        ``compile_root`` and it is the only unit) and register ``generate`` to gather."""
        move_metrics(module, device)  # first: a metric built on meta is refused before sharding
        if is_sharded(module):
            log.debug("flatshard: model is already sharded; reusing its units.")
        else:
            config = mixed_precision_for(precision_flag, self.options.mixed_precision)
            options = self.options.shard_options(device, config, ranks_per_node, world_size, device_mesh)
            shard(module, options)
        if self.options.compile is not None:  # see [Note: torch.compile]
            compiled = compile_units(module, self.options.compile, root=compile_root)
            log.debug("flatshard: compiled %d units", len(compiled))
        if generate := register_generate(module):  # see [Note: methods other than forward]
            log.debug("flatshard: generate() registered to gather on %s", generate)
        return module

    def check_precision_flag(self, flag: str) -> None:
        """A precision flag that contradicts ``mixed_precision`` fails when the Trainer or Fabric is built."""
        mixed_precision_for(flag, self.options.mixed_precision)

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def refuse_storage_options(storage_options: Any, who: str) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{who}.save_checkpoint(..., storage_options=...) is not supported: flatshard writes checkpoints "
                "itself, to local paths and fsspec URLs alike. HINT: drop storage_options."
            )

    def write(self, checkpoint: Mapping[str, Any], path: Any, names: Names | None = None) -> None:
        """Write a prepared checkpoint: in the background (``async_save``), as a sharded directory written by
        every rank, or as one full file from rank 0; every rank raises if any failed."""
        if self.async_saver is not None:  # see [Note: asynchronous sharded saves]
            self.async_saver.save(checkpoint, path, names)
        elif self.options.state_dict_type == "sharded":
            write_sharded_checkpoint(checkpoint, path, names)
        else:
            write_full_checkpoint(dict(checkpoint), path)

    def before_load(self) -> None:
        """A load reads only complete saves: wait for the one in flight (every rank calls)."""
        if self.async_saver is not None:
            self.async_saver.wait(collective=True)

    def remove(self, path: Any, global_zero: bool) -> None:
        """Remove a checkpoint (file or sharded directory, local or at a URL) once no save writes it."""
        if self.async_saver is not None:
            self.async_saver.wait_for(path)  # another path is safe to remove while a save is written
        if global_zero:
            remove_checkpoint(path)

    def wait_for_save(self) -> None:
        """Wait for the asynchronous save in flight and raise its error, naming the path."""
        if self.async_saver is not None:
            self.async_saver.wait()

    def abandon_save(self) -> None:
        """The run failed: a save whose peers may never finish is not waited for (see the saver)."""
        if self.async_saver is not None:
            self.async_saver.abandon()

    # ------------------------------------------------------------------ launcher
    def launcher(self, strategy: Any, spawn: type, script: type) -> Any:
        """The launcher for ``start_method``: ``spawn`` or the script launcher (``None`` when processes are
        created externally, by torchrun or SLURM)."""
        environment = strategy.cluster_environment
        assert environment is not None
        if self.options.start_method == "spawn":
            return spawn(strategy, start_method="spawn")
        if not environment.creates_processes_externally:
            return script(environment, strategy.num_processes, strategy.num_nodes)
        return None


class ShellMembers:
    """What both shells answer Lightning the same way; listed before Lightning's base class, so that these win.

    :meth:`_take_arguments` is the first line of a shell's ``__init__``: the options, then the process-group
    arguments, before Lightning's base ``__init__`` (whose precision setter checks the flag against them).
    """

    _core: StrategyCore
    _device_mesh: Any = None  # built by tensor_parallel_size: see build_device_mesh
    _process_group_backend: str | None
    _timeout: timedelta | None
    if TYPE_CHECKING:  # Lightning's base classes have these
        parallel_devices: list[torch.device] | None
        local_rank: int
        global_rank: int
        num_nodes: int

    def _take_arguments(
        self,
        declared_by: type,
        options: Mapping[str, Any],
        process_group_backend: str | None,
        timeout: timedelta | None,
    ) -> None:
        self._core = StrategyCore(StrategyOptions.from_arguments(options, declared_by))
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    @property
    def options(self) -> StrategyOptions:
        return self._core.options

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self) -> Any:
        """The ``("data_parallel", "tensor_parallel")`` mesh of ``tensor_parallel_size`` (``None`` without it),
        once the processes are initialized."""
        return self._device_mesh

    def build_device_mesh(self) -> Any:
        """Build the mesh ``tensor_parallel_size`` asks for (collective, after the process group starts)."""
        world = self.num_nodes * self.num_processes
        self._device_mesh = self.options.build_mesh(world, self.num_processes, self.root_device)
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        world = self.num_nodes * self.num_processes
        mesh = self._device_mesh
        if mesh is not None:  # ranks of one tensor-parallel group (its last dimension) read the same batch
            tp = mesh.size(mesh.ndim - 1)
            return {"num_replicas": world // tp, "rank": self.global_rank // tp}
        return {"num_replicas": world, "rank": self.global_rank}

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)
