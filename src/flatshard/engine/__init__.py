"""The sharding engine: no Lightning import here; usable from plain PyTorch.

This module is the engine's contract: every name the rest of the package (``checkpoint/``, ``lightning/``,
``cli.py``, ``testing/``) uses is exported here and imported from ``flatshard.engine``, never from a
submodule. Layout (see ``docs/concepts.md`` for a map by question):

- the core: ``config`` (options), ``shard`` (the entry point), ``flat_param`` (index math), ``handle`` (one
  unit's flat parameter: the gather path), ``gradients`` (the gradient path), ``precision``, ``runtime``
  (the hooks), ``exec_order`` (prefetch order), ``activation_offload`` (saved activations in host memory between a
  unit's forward and its backward), ``unit_layout`` (a sharded module's layout as records, for
  planning tools);
- ``setup/``: what ``shard()`` does once: unit planning, materializing, process groups, activation
  checkpointing;
- ``calls/``: calling a sharded model beyond forward: other methods (``generate``), ``torch.compile``,
  uneven loops (join);
- ``step/``: at the optimizer step: gradient clipping, EMA, whole-tensor optimizers, the offloaded step;
- ``state/``: full and sharded model / optimizer state, the streamed gather, ``unshard_params``;
- ``transport/``: collectives, the shared-memory transport, memory blocks, streams, the limiter, the
  desync watchdog.
"""

from flatshard.engine.activation_offload import OffloadStats
from flatshard.engine.calls.compile import compile_kwargs, compile_units
from flatshard.engine.calls.forward_methods import (
    is_forward_method,
    register_forward_method,
    register_generate,
)
from flatshard.engine.calls.join import JoinState, begin_join, end_join, join
from flatshard.engine.config import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptionErrors,
    ShardingStrategy,
    ShardOptions,
)
from flatshard.engine.handle import handle_of_param
from flatshard.engine.runtime import (
    ForwardCall,
    begin_backward_in_forward,
    forward_call,
    regather_in_forward,
    unit_states,
)
from flatshard.engine.setup.activation_checkpointing import CheckFn
from flatshard.engine.setup.materialize import (
    Initializers,
    Materialized,
    adapters_of,
    hf_owners,
    materialize_modules,
)
from flatshard.engine.setup.wrap import Policy
from flatshard.engine.shard import (
    is_sharded,
    no_sync,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_forward,
    shard,
)
from flatshard.engine.state.full_entries import FullEntry, full_entries
from flatshard.engine.state.full_model import (
    check_full_model_state_dict,
    full_model_state_dict,
    load_full_model_state_dict,
    parameter_names,
    prepare_for_state_io,
)
from flatshard.engine.state.full_optim import (
    convert_full_optim_state_dict,
    full_optim_state_dict,
    load_converted_optim_state,
    load_full_optim_state_dict,
)
from flatshard.engine.state.optim_binding import original_shapes, rebind_optimizer
from flatshard.engine.state.sharded import (
    ParamShard,
    local_param_targets,
    param_shard,
    sharded_model_state_dict,
    sharded_optim_state_dict,
    to_local_model_state,
    to_local_optim_state,
)
from flatshard.engine.state.stand_ins import saved_piece, stand_in
from flatshard.engine.state.state_dict import FullStates, get_state_dict, optimizer_list, set_state_dict
from flatshard.engine.state.unshard_params import unshard_params
from flatshard.engine.state.whole_state import after_load as finish_optimizer_load
from flatshard.engine.step.clip import clip_grad_norm_, clip_grad_norm_params_
from flatshard.engine.step.ema import EMA, check_decay
from flatshard.engine.step.optimizer_offload import state_device
from flatshard.engine.step.whole_tensor import (
    explaining_step_errors,
    is_whole_tensor_optimizer,
    register_whole_tensor_optimizer,
    whole_tensor_classes,
)
from flatshard.engine.transport.comm import comm_stats, global_rank, group_traffic, timeline, uses_nccl
from flatshard.engine.transport.groups import world_state
from flatshard.engine.transport.processes import ProcessId
from flatshard.engine.transport.watchdog import DesyncError, wait_collective
from flatshard.engine.unfilled import UnfilledError
from flatshard.engine.unit_layout import (
    UnitLayout,
    activation_offload_stats,
    gathered_buffers,
    unit_layouts,
    whole_tensor_owners,
)

__all__ = [
    "EMA",
    "BackwardPrefetch",
    "CPUOffload",
    "CheckFn",
    "DesyncError",
    "ForwardCall",
    "FullEntry",
    "FullStates",
    "Initializers",
    "JoinState",
    "Materialized",
    "MixedPrecision",
    "OffloadStats",
    "OptionErrors",
    "ParamShard",
    "Policy",
    "ProcessId",
    "ShardOptions",
    "ShardingStrategy",
    "UnfilledError",
    "UnitLayout",
    "activation_offload_stats",
    "adapters_of",
    "begin_backward_in_forward",
    "begin_join",
    "check_decay",
    "check_full_model_state_dict",
    "clip_grad_norm_",
    "clip_grad_norm_params_",
    "comm_stats",
    "compile_kwargs",
    "compile_units",
    "convert_full_optim_state_dict",
    "end_join",
    "explaining_step_errors",
    "finish_optimizer_load",
    "forward_call",
    "full_entries",
    "full_model_state_dict",
    "full_optim_state_dict",
    "gathered_buffers",
    "get_state_dict",
    "global_rank",
    "group_traffic",
    "handle_of_param",
    "hf_owners",
    "is_forward_method",
    "is_sharded",
    "is_whole_tensor_optimizer",
    "join",
    "load_converted_optim_state",
    "load_full_model_state_dict",
    "load_full_optim_state_dict",
    "local_param_targets",
    "materialize_modules",
    "no_sync",
    "optimizer_list",
    "original_shapes",
    "param_shard",
    "parameter_names",
    "prepare_for_state_io",
    "rebind_optimizer",
    "regather_in_forward",
    "register_forward_method",
    "register_generate",
    "register_whole_tensor_optimizer",
    "saved_piece",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_forward",
    "set_state_dict",
    "shard",
    "sharded_model_state_dict",
    "sharded_optim_state_dict",
    "stand_in",
    "state_device",
    "timeline",
    "to_local_model_state",
    "to_local_optim_state",
    "unit_layouts",
    "unit_states",
    "unshard_params",
    "uses_nccl",
    "wait_collective",
    "whole_tensor_classes",
    "whole_tensor_owners",
    "world_state",
]
