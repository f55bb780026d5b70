"""The contenders of ``step_time.py`` (flatshard, FSDP1, FSDP2, DDP), which ``memory.py`` builds the same way,
and the ranks they run on (:func:`spawn_ranks`, :func:`barrier`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_model import Block, build_model

# ----------------------------------------------------------------------------------------------------------
# The contenders of step_time.py (memory.py builds its peers the same way)
# ----------------------------------------------------------------------------------------------------------

FLATSHARD_CONTENDERS = (
    "flatshard",
    "flatshard_grad_op",
    "flatshard_compiled",
    "flatshard_root_resharded",
    "flatshard_adamw",
)
CONTENDER_DESCRIPTIONS = {
    "flatshard": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}",
    "flatshard_grad_op": "flatshard.shard SHARD_GRAD_OP, auto_wrap_policy={Block}",
    "flatshard_compiled": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, each Block compiled in place"
    " (compile_units: torch.compile, the config's compile_kwargs)",
    "flatshard_root_resharded": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, "
    "reshard_root_after_forward=True (the root resharded after forward, as the fsdp2 contender's)",
    "flatshard_adamw": "flatshard.shard FULL_SHARD, auto_wrap_policy={Block}, AdamW on every parameter (beside "
    "--optimizer muon: the elementwise baseline)",
    "fsdp1": "torch FSDP1 FULL_SHARD, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp1_grad_op": "torch FSDP1 SHARD_GRAD_OP, ModuleWrapPolicy({Block}), use_orig_params=True",
    "fsdp2": "torch FSDP2 fully_shard per Block then root (reshard_after_forward=True)",
    "fsdp2_grad_op": "torch FSDP2 fully_shard per Block then root, reshard_after_forward=False",
    "ddp": "torch DistributedDataParallel (full replica per rank)",
}


def _mp_dtypes(cfg: dict[str, Any]) -> tuple[torch.dtype, torch.dtype]:
    return torch.bfloat16, getattr(torch, cfg["reduce_dtype"])


def _wrap_flatshard(
    model: torch.nn.Module, cfg: dict[str, Any], device: torch.device, strategy: str, info: dict[str, Any]
) -> torch.nn.Module:
    """Shard with flatshard. Options this flatshard does not implement yet (``NotImplementedError``) are
    dropped one at a time when they were asked for in ``auto`` mode (or are the bf16 mixed precision):
    first the one the error message names, else mixed precision, forward prefetch, backward prefetch."""
    import flatshard

    bwd = cfg["flatshard_backward_prefetch"]
    fwd = cfg["flatshard_forward_prefetch"]
    opts: dict[str, Any] = {
        "mixed_precision": None,
        "forward_prefetch": fwd in ("on", "auto"),
        "backward_prefetch": {"auto": "BACKWARD_PRE", "none": None}.get(bwd, bwd),
    }
    extra = {"reshard_root_after_forward": True} if cfg.get("contender") == "flatshard_root_resharded" else {}
    defaults: dict[str, Any] = {"mixed_precision": None, "forward_prefetch": False, "backward_prefetch": None}
    droppable = []
    if cfg["precision"] == "bf16-mixed":
        param_dtype, reduce_dtype = _mp_dtypes(cfg)
        opts["mixed_precision"] = flatshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        droppable.append("mixed_precision")  # then flatshard runs in fp32, and the output says so
    if fwd == "auto":
        droppable.append("forward_prefetch")
    if bwd == "auto":
        droppable.append("backward_prefetch")
    fallbacks: list[str] = []
    shapes = [p.shape for p in model.parameters()]
    while True:
        touched = [p.shape for p in model.parameters()] != shapes or any(
            flatshard.is_sharded(m) for m in model.modules()
        )
        if touched:  # a failed shard() changed the module: rebuild it from the seed
            model = build_model(cfg)
        try:
            flatshard.shard(
                model,
                sharding_strategy=strategy,
                auto_wrap_policy={Block},
                limit_all_gathers=True,
                device=device,
                **opts,
                **extra,
            )
            break
        except NotImplementedError as err:
            candidates = [k for k in droppable if opts[k] != defaults[k]]
            if not candidates:
                raise
            named = [k for k in candidates if k in str(err)]
            drop = (named or candidates)[0]
            fallbacks.append(
                f"{drop}={opts[drop]!r} -> {defaults[drop]!r} (NotImplementedError: {str(err).splitlines()[0]})"
            )
            opts[drop] = defaults[drop]
    info["flatshard_options"] = {
        "backward_prefetch": opts["backward_prefetch"],
        "forward_prefetch": opts["forward_prefetch"],
        "mixed_precision": None if opts["mixed_precision"] is None else repr(opts["mixed_precision"]),
        "limit_all_gathers": True,
        **extra,
        "requested": {"backward_prefetch": bwd, "forward_prefetch": fwd, "precision": cfg["precision"]},
        "fallbacks": fallbacks,
    }
    if cfg["precision"] == "bf16-mixed" and opts["mixed_precision"] is None:
        info["precision_used"] = "fp32 (flatshard mixed precision not available: see fallbacks)"
    return model


def wrap_contender(
    name: str, model: torch.nn.Module, cfg: dict[str, Any], rank: int, device: torch.device, info: dict
) -> torch.nn.Module:
    """Shard or replicate ``model`` as the contender ``name`` of ``step_time.py`` (one unit per ``Block``)."""
    mixed = cfg["precision"] == "bf16-mixed"
    if name in FLATSHARD_CONTENDERS:
        strategy = "SHARD_GRAD_OP" if name == "flatshard_grad_op" else "FULL_SHARD"
        model = _wrap_flatshard(model, {**cfg, "contender": name}, device, strategy, info)
        if name == "flatshard_compiled":  # what FlatShardStrategy(compile=...) does after sharding
            from flatshard.engine import compile_units

            kwargs = dict(cfg.get("compile_kwargs") or {})
            info["compiled_units"] = len(compile_units(model, kwargs))
            info["compile_kwargs"] = {k: str(v) for k, v in kwargs.items()}
        return model
    if name in ("fsdp1", "fsdp1_grad_op"):
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = None
        if mixed:
            param_dtype, reduce_dtype = _mp_dtypes(cfg)
            mp = FSDPMixedPrecision(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype
            )
        # By default FSDP1 prefetches in forward exactly when flatshard is asked to (like for like);
        # --fsdp1-forward-prefetch off keeps FSDP1 at its own default instead.
        fwd_prefetch = (
            cfg["flatshard_forward_prefetch"] in ("on", "auto")
            and cfg.get("fsdp1_forward_prefetch", "same") != "off"
        )
        info["fsdp1_options"] = {
            "backward_prefetch": "BACKWARD_PRE (FSDP1 default)",
            "forward_prefetch": fwd_prefetch,
            "limit_all_gathers": True,
            "device_id": str(device),
        }
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.FULL_SHARD
            if name == "fsdp1"
            else ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            # torch 2.13 refuses device_id=None for a CPU module ("FSDP needs a non-CPU accelerator
            # device"); an explicit CPU device selects FSDP1's CPU/gloo path.
            device_id=device,
            mixed_precision=mp,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=fwd_prefetch,
            limit_all_gathers=True,
        )
    if name in ("fsdp2", "fsdp2_grad_op"):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": name == "fsdp2"}
        if mixed:
            param_dtype, reduce_dtype = _mp_dtypes(cfg)
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if device.type == "cuda":
            return DistributedDataParallel(model.to(device), device_ids=[device.index])
        return DistributedDataParallel(model)
    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------------------------------------
# Ranks and process groups
# ----------------------------------------------------------------------------------------------------------


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str, timeout: float
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with a fresh process group
    (``flatshard.testing.spawn``); returns the per-rank results."""
    from flatshard.testing import spawn

    return spawn(fn, world_size, *args, backend=backend, timeout=timeout)


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:  # gloo: ranks may share a GPU, and device_ids is an NCCL notion
            dist.barrier()
        torch.cuda.synchronize(device)
    else:
        dist.barrier()
