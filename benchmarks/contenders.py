"""The contender registry: flatshard and its peers, each built one way for every scenario, and the ranks they
run on. A contender is a name, a family (``flatshard``, ``fsdp1``, ``fsdp2``, ``ddp``, ``unsharded``, ``hf``) and
the options that set it apart within its family; every GPT contender has one unit per ``Block``. The
``tensor_parallel`` option marks the contenders of the tensor-parallel Llama (:func:`wrap_tp`), one unit per its
``Block``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .model import Block


@dataclass(frozen=True)
class Contender:
    name: str
    family: str
    description: str
    options: dict[str, Any] = field(default_factory=dict)


_FS = "flatshard.shard, one unit per Block, "
REGISTRY: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("flatshard", "flatshard", _FS + "FULL_SHARD, BACKWARD_PRE"),
        Contender("flatshard_grad_op", "flatshard", _FS + "SHARD_GRAD_OP", {"strategy": "SHARD_GRAD_OP"}),
        Contender("flatshard_hybrid", "flatshard", _FS + "HYBRID_SHARD", {"strategy": "HYBRID_SHARD"}),
        Contender(
            "flatshard_hybrid_zero2",
            "flatshard",
            _FS + "HYBRID_SHARD_ZERO2",
            {"strategy": "HYBRID_SHARD_ZERO2"},
        ),
        Contender(
            "flatshard_root_resharded",
            "flatshard",
            _FS + "reshard_root_after_forward=True (the root freed after forward, as the fsdp2 contender's)",
            {"reshard_root_after_forward": True},
        ),
        Contender("flatshard_compiled", "flatshard", _FS + "each Block compiled in place (compile_units)"),
        Contender(
            "flatshard_float8",
            "flatshard",
            _FS + "torchao float8 (tensorwise, float8 all-gather)",
            {"float8": True},
        ),
        Contender(
            "flatshard_compiled_float8",
            "flatshard",
            _FS + "torchao float8 (tensorwise, float8 all-gather), each Block compiled in place",
            {"float8": True},
        ),
        Contender(
            "flatshard_checkpointed",
            "flatshard",
            _FS + "activation_checkpointing_policy={Block}",
            {"activation_checkpointing_policy": {Block}},
        ),
        Contender(
            "flatshard_selective",
            "flatshard",
            _FS + 'activation_checkpointing_policy={Block}, activation_checkpointing_mode="selective"',
            {"activation_checkpointing_policy": {Block}, "activation_checkpointing_mode": "selective"},
        ),
        Contender(
            "flatshard_no_sync",
            "flatshard",
            _FS + "micro-batches but the last inside flatshard.no_sync",
            {"no_sync": True},
        ),
        Contender(
            "flatshard_hybrid_no_sync",
            "flatshard",
            _FS + "HYBRID_SHARD, micro-batches but the last inside flatshard.no_sync (one all-reduce across "
            "replicas per optimizer step)",
            {"strategy": "HYBRID_SHARD", "no_sync": True},
        ),
        Contender(
            "flatshard_node_copy",
            "flatshard",
            _FS + "FULL_SHARD, reshard_after_forward=<--ranks-per-node> (backward gathers inside a node)",
            {"node_copy": True},
        ),
        Contender(
            "flatshard_no_prefetch", "flatshard", _FS + "backward_prefetch=None", {"backward_prefetch": None}
        ),
        Contender(
            "flatshard_backward_post",
            "flatshard",
            _FS + "BACKWARD_POST",
            {"backward_prefetch": "BACKWARD_POST"},
        ),
        Contender(
            "flatshard_forward_prefetch",
            "flatshard",
            _FS + "BACKWARD_PRE, forward_prefetch=True",
            {"forward_prefetch": True},
        ),
        Contender(
            "flatshard_offload_optimizer",
            "flatshard",
            _FS + 'cpu_offload="optimizer" (the optimizer state and its step in host memory)',
            {"cpu_offload": "optimizer"},
        ),
        Contender(
            "fsdp1", "fsdp1", "torch FSDP1 FULL_SHARD, ModuleWrapPolicy({Block}), use_orig_params=True"
        ),
        Contender(
            "fsdp1_grad_op",
            "fsdp1",
            "torch FSDP1 SHARD_GRAD_OP, ModuleWrapPolicy({Block}), use_orig_params=True",
            {"strategy": "SHARD_GRAD_OP"},
        ),
        Contender(
            "fsdp2", "fsdp2", "torch FSDP2 fully_shard per Block, then the root (reshard_after_forward=True)"
        ),
        Contender(
            "fsdp2_compiled",
            "fsdp2",
            "torch FSDP2 fully_shard per Block, then the root; each Block compiled in place (block.compile())",
        ),
        Contender(
            "fsdp2_float8",
            "fsdp2",
            "torch FSDP2 fully_shard per Block, then the root; torchao float8 (tensorwise, float8 all-gather)",
            {"float8": True},
        ),
        Contender(
            "fsdp2_compiled_float8",
            "fsdp2",
            "torch FSDP2 fully_shard per Block, then the root; torchao float8 (tensorwise, float8 all-gather), "
            "each Block compiled in place",
            {"float8": True},
        ),
        Contender(
            "fsdp2_grad_op",
            "fsdp2",
            "torch FSDP2 fully_shard per Block, then the root, reshard_after_forward=False",
            {"reshard_after_forward": False},
        ),
        Contender(
            "ddp", "ddp", "torch DistributedDataParallel: a full replica per rank (micro-batches: no_sync)"
        ),
        Contender("unsharded", "unsharded", "the plain model, nothing sharded (the reference)"),
        Contender(
            "adamw_naive",
            "unsharded",
            "torch.optim.AdamW(foreach=False) on plain CPU tensors: the per-tensor loop",
            {"adamw": {"foreach": False}},
        ),
        Contender(
            "adamw_foreach",
            "unsharded",
            "torch.optim.AdamW(foreach=True) on plain CPU tensors",
            {"adamw": {"foreach": True}},
        ),
        Contender(
            "adamw_fused",
            "unsharded",
            "torch.optim.AdamW(fused=True) on plain CPU tensors: torch's fused CPU kernel",
            {"adamw": {"fused": True}},
        ),
        Contender("hf", "hf", "Hugging Face transformers: from_pretrained / save_pretrained"),
        Contender(
            "flatshard_tp",
            "flatshard",
            "the Llama plan on the tensor_parallel mesh, then flatshard.shard(model, device_mesh=mesh), one unit "
            "per Block, FULL_SHARD, BACKWARD_PRE, over data_parallel",
            {"tensor_parallel": True},
        ),
        Contender(
            "fsdp2_tp",
            "fsdp2",
            "the Llama plan on the tensor_parallel mesh, then torch FSDP2 fully_shard on the data_parallel mesh per "
            "Block and the root (what Lightning's ModelParallelStrategy asks of configure_model)",
            {"tensor_parallel": True},
        ),
    )
}


def get(name: str) -> Contender:
    if name not in REGISTRY:
        raise ValueError(f"unknown contender {name!r}. HINT: choose from {', '.join(REGISTRY)}")
    return REGISTRY[name]


def _mixed(cfg: dict[str, Any]) -> tuple[torch.dtype, torch.dtype] | None:
    if cfg.get("precision") != "bf16-mixed":
        return None
    return torch.bfloat16, getattr(torch, cfg.get("reduce_dtype", "float32"))


def compiled(name: str) -> bool:
    """Whether the contender compiles each ``Block`` in place after wrapping."""
    return "_compiled" in name


def float8(name: str, cfg: dict[str, Any]) -> bool:
    """Whether the contender's model is converted to torchao float8 training (its name, or ``--float8``)."""
    return bool(get(name).options.get("float8") or cfg.get("float8"))


def float8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """The linears torchao converts, the same for every contender: ``nn.Linear`` inside a ``Block`` whose
    dimensions are multiples of 16 (float8 matmuls need them); the output head (``lm_head``, tied to the
    embedding) stays in high precision, as torchao recommends."""
    return (
        isinstance(module, torch.nn.Linear)
        and fqn.startswith("blocks.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_float8(model: torch.nn.Module, family: str) -> int:
    """torchao's tensorwise float8 recipe on :func:`float8_filter`'s linears, before wrapping; returns how many.
    flatshard and FSDP2 gather the weights in float8 (``enable_fsdp_float8_all_gather=True``). FSDP1 and DDP run
    the same float8 matmuls with that switch off: torchao's float8 all-gather is an FSDP2 extension (FSDP1's flat
    parameters have no per-weight cast), so FSDP1 gathers the weights in high precision, and DDP has nothing to
    gather."""
    if family not in ("flatshard", "fsdp2", "fsdp1", "ddp"):
        raise ValueError(f"float8: the {family} contenders do not train. HINT: float8 is a train option")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=family in ("flatshard", "fsdp2"))
    convert_to_float8_training(model, module_filter_fn=float8_filter, config=config)
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    if not converted:
        raise ValueError(
            "float8: no Block linear has dimensions that are multiples of 16. HINT: choose --d-model a multiple "
            "of 16"
        )
    return converted


def after_optimizer_step(name: str, model: torch.nn.Module, cfg: dict[str, Any]) -> None:
    """What the contender's users run after ``optimizer.step()``: FSDP2 with float8 weights computes the next
    step's scales there, in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); flatshard
    does the same at the start of the next forward."""
    if float8(name, cfg) and get(name).family == "fsdp2":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def wrap(name: str, model: torch.nn.Module, cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """Shard or replicate ``model`` (built on every rank from the same seed) as the contender ``name``; a float8
    contender's model is converted first (:func:`convert_float8`)."""
    c = get(name)
    if c.options.get("tensor_parallel"):
        raise ValueError(
            f"contender {name!r} trains the tensor-parallel Llama, not a GPT. HINT: python -m benchmarks "
            "tensor_parallel"
        )
    mixed = _mixed(cfg)
    if float8(name, cfg):
        convert_float8(model, c.family)
    if c.family == "flatshard":
        import flatshard

        opts: dict[str, Any] = {
            "sharding_strategy": c.options.get("strategy", "FULL_SHARD"),
            "backward_prefetch": c.options.get("backward_prefetch", "BACKWARD_PRE"),
            "forward_prefetch": c.options.get("forward_prefetch", False),
            "limit_all_gathers": True,
            "device": device,
        }
        for key in (
            "reshard_root_after_forward",
            "activation_checkpointing_policy",
            "activation_checkpointing_mode",
            "cpu_offload",
        ):
            if key in c.options:
                opts[key] = c.options[key]
        if opts["sharding_strategy"].startswith("HYBRID"):
            opts["shard_group_size"] = cfg["shard_group_size"]
        if c.options.get("node_copy"):
            if not cfg.get("ranks_per_node"):
                raise ValueError(f"{name} keeps a copy per node. HINT: give --ranks-per-node R")
            opts["reshard_after_forward"] = cfg["ranks_per_node"]
        if mixed:
            opts["mixed_precision"] = flatshard.MixedPrecision(param_dtype=mixed[0], reduce_dtype=mixed[1])
        flatshard.shard(model, auto_wrap_policy={Block}, **opts)
        if compiled(name):  # what FlatShardStrategy(compile=...) does after sharding
            from flatshard.engine import compile_units

            compile_units(model, cfg["compile_kwargs"])
        return model
    if c.family == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            sharding_strategy=ShardingStrategy[c.options.get("strategy", "FULL_SHARD")],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=device,  # torch 2.13 refuses None for a CPU module; a CPU device selects the CPU path
            mixed_precision=MixedPrecision(param_dtype=mixed[0], reduce_dtype=mixed[1], buffer_dtype=mixed[0])
            if mixed
            else None,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            limit_all_gathers=True,
        )
    if c.family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": c.options.get("reshard_after_forward", True),
        }
        if mixed:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed[0], reduce_dtype=mixed[1])
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if compiled(
            name
        ):  # as flatshard_compiled: each Block in place after sharding; FSDP2's hooks stay eager
            for block in blocks:
                block.compile(**cfg["compile_kwargs"])
        return model
    if c.family == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model.to(device), device_ids=ids)
    if c.family == "unsharded":
        return model.to(device)
    raise ValueError(
        f"contender {name!r} ({c.family}) does not wrap a GPT. HINT: it belongs to another scenario"
    )


def accumulating(name: str, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The context a micro-batch before the last runs in: gradients kept unreduced where the contender's users
    do that (``flatshard_no_sync``, ``flatshard_hybrid_no_sync``, DDP), a plain backward otherwise (each one
    reduces fully: under hybrid sharding a reduce-scatter in the shard group and an all-reduce across replicas)."""
    if get(name).options.get("no_sync"):
        import flatshard

        return flatshard.no_sync(model)
    if get(name).family == "ddp":
        return model.no_sync()  # type: ignore[no-any-return, operator]
    return contextlib.nullcontext()


def full_state(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    """The full, consolidated model and optimizer state on rank 0, on the CPU (other ranks: empty or ignored),
    each family's own way."""
    family = get(name).family
    if family == "flatshard":
        import flatshard

        return flatshard.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)
    if family == "fsdp1":
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=True segfaults on a CPU model in torch 2.13; on CPU the tensors are CPU tensors anyway
        offload = next(model.parameters()).is_cuda
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        ):
            return model.state_dict(), FSDP.optim_state_dict(model, opt)
    if family == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if family == "ddp":
        return model.module.state_dict(), opt.state_dict()  # type: ignore[operator]
    raise ValueError(f"contender {name!r} has no full state")


def load_full_state(
    name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, msd: Any, osd: Any
) -> None:
    """Load a full state (on every rank) the family's own way."""
    family = get(name).family
    if family == "flatshard":
        import flatshard

        flatshard.set_state_dict(model, opt, msd, osd)
    elif family in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    elif family == "ddp":
        model.module.load_state_dict(msd)  # type: ignore[operator]
        opt.load_state_dict(osd)
    else:
        raise ValueError(f"contender {name!r} has no full state")


# ----------------------------------------------------------------------------------------------------------
# Tensor parallel x data parallel (the Llama of tp_model.py on a 2-D mesh)
# ----------------------------------------------------------------------------------------------------------


def wrap_tp(name: str, model: torch.nn.Module, mesh: Any, device: torch.device) -> torch.nn.Module:
    """Apply the Llama plan on ``mesh["tensor_parallel"]``, then shard over ``mesh["data_parallel"]`` as the
    contender ``name``: flatshard's ``shard(model, device_mesh=mesh)`` (the 2-D mesh: flatshard finds the
    data-parallel dimension itself), or FSDP2's ``fully_shard`` per ``Block`` and the root on the data-parallel
    mesh, as Lightning's ``ModelParallelStrategy`` expects ``configure_model`` to do."""
    from .tp_model import Block as LlamaBlock
    from .tp_model import llama_plan

    c = get(name)
    if not c.options.get("tensor_parallel"):
        raise ValueError(f"contender {name!r} does not run tensor parallel. HINT: flatshard_tp or fsdp2_tp")
    llama_plan(model, mesh["tensor_parallel"])  # type: ignore[arg-type]
    if c.family == "flatshard":
        import flatshard

        flatshard.shard(
            model,
            device_mesh=mesh,
            auto_wrap_policy={LlamaBlock},
            sharding_strategy="FULL_SHARD",
            backward_prefetch="BACKWARD_PRE",
            limit_all_gathers=True,
            device=device,
        )
        return model
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["data_parallel"]
    for block in model.modules():
        if isinstance(block, LlamaBlock):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)
    return model


def save_sharded_tp(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """A sharded DCP directory of the model and the optimizer, each family's own way: flatshard's
    ``save_checkpoint(state_dict_type="sharded")``; for FSDP2 what Lightning's ``ModelParallelStrategy`` does,
    ``dcp.save`` of ``get_model_state_dict`` and ``get_optimizer_state_dict`` (sharded)."""
    c = get(name)
    if not c.options.get("tensor_parallel"):
        raise ValueError(f"contender {name!r} has no tensor-parallel save. HINT: flatshard_tp or fsdp2_tp")
    if c.family == "flatshard":
        import flatshard

        flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded")
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=path)


# ----------------------------------------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------------------------------------


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, cfg: dict[str, Any]) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` fresh (``spawn``-ed) processes with a fresh process group.
    ``cfg["malloc_mmap_threshold"]`` is set in this process's environment while the ranks start, since glibc
    reads ``MALLOC_MMAP_THRESHOLD_`` when a process starts."""
    from flatshard.testing import spawn

    key, saved = "MALLOC_MMAP_THRESHOLD_", os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if cfg.get("malloc_mmap_threshold"):
        os.environ[key] = str(cfg["malloc_mmap_threshold"])
    else:
        os.environ.pop(key, None)
    try:
        backend, timeout = cfg.get("backend", "gloo"), cfg["timeout"]
        return spawn(fn, world, *args, backend=backend, timeout=timeout, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def rank_device(cfg: dict[str, Any], rank: int) -> torch.device:
    """CPU, or a GPU per rank (under gloo, ranks beyond the GPU count share them)."""
    torch.set_num_threads(cfg["threads"])
    if cfg.get("device") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def barrier(device: torch.device) -> None:
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
