"""``flatshard estimate TARGET --world-size N [options]``: the estimator's command line (see ``flatshard/cli.py``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch.nn as nn

from flatshard.estimator.api import estimate
from flatshard.estimator.options import LINKS, OPTIMIZERS
from flatshard.estimator.report import format_table
from flatshard.estimator.target import EstimateError

__all__ = ["add_parser", "run"]


class ClassNames:
    """A wrap / checkpointing policy naming module classes by ``__name__`` (``--wrap LlamaBlock``): the classes
    of the estimated model need no import path."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, module: nn.Module, recurse: bool = False, nonwrapped_numel: int = 0) -> bool:
        return recurse or type(module).__name__ in self.names

    def __repr__(self) -> str:
        return f"classes named {', '.join(self.names)}"


class _CheckNames(ClassNames):
    def __call__(self, module: nn.Module, recurse: bool = False, nonwrapped_numel: int = 0) -> bool:
        return type(module).__name__ in self.names


def _policy(value: str | None, what: str, checkpointing: bool = False) -> Any:
    """``"LlamaBlock"`` / ``"pkg.mod.LlamaBlock"`` (comma-separated) / ``"1000000"`` -> a policy the options take."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return int(value)
    items = [v for v in value.replace(" ", "").split(",") if v]
    if not items:
        raise EstimateError(f"{what}={value!r} names no class. HINT: e.g. {what} TransformerBlock.")
    if all("." in v for v in items):
        return set(items)  # import paths: resolved (and checked) by the strategy's own options
    if any("." in v for v in items):
        raise EstimateError(
            f"{what}={value!r} mixes import paths and bare class names. HINT: use one form: bare names are matched "
            "against the model's module classes."
        )
    return (_CheckNames if checkpointing else ClassNames)(tuple(items))


def _checkpointing_mode(value: str, checkpoint: str | None) -> str | list[str]:
    """``full`` / ``selective`` / ``aten.mm,aten.addmm`` (operators to keep)."""
    text = value.strip()
    if checkpoint is None and text.lower() != "full":
        raise EstimateError(
            f"--activation-checkpointing-mode {value} says what checkpointed modules keep, and --checkpoint names "
            "none. HINT: add --checkpoint with the layers' class, e.g. --checkpoint LlamaBlock."
        )
    if text.lower() in ("full", "selective") or ("," not in text and "." not in text):
        return text  # a mode, or a wrong one that the options name
    return [v for v in text.replace(" ", "").split(",") if v]


def _mixed_precision(value: str | None) -> Any:
    """``bf16`` (compute and reduce in bf16), ``bf16,fp32`` (reduce in fp32), ``none``."""
    if value is None or value.strip().lower() in ("none", "fp32", "32"):
        return None
    parts = [v for v in value.replace(" ", "").split(",") if v]
    if len(parts) > 2:
        raise EstimateError(
            f"--mixed-precision={value!r} has {len(parts)} dtypes. HINT: give the compute dtype and optionally the "
            "reduce dtype: bf16, or bf16,fp32."
        )
    mp = {"param_dtype": parts[0]}
    if len(parts) == 2:
        mp["reduce_dtype"] = parts[1]
    return mp


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-rank memory and step communication of sharded training on N GPUs, before renting them",
        description="Build TARGET on the meta device, shard it with flatshard's engine at each world size (no "
        "memory, no GPU), run a training step when TARGET gives an example batch, and report per-rank memory and "
        "communication per step.",
    )
    p.add_argument(
        "target",
        help="module.path:factory, a callable returning the model or (model, example_batch); it runs under "
        "torch.device('meta')",
    )
    p.add_argument("--world-size", "-n", required=True, help="ranks (GPUs): N or a list, e.g. 8,64,512")
    p.add_argument(
        "--strategy",
        default="FULL_SHARD",
        help="FULL_SHARD (default), SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2",
    )
    p.add_argument(
        "--wrap",
        default=None,
        help="units: module class names (LlamaBlock), import paths, or a parameter count",
    )
    p.add_argument(
        "--checkpoint", default=None, help="activation checkpointing: module class names or import paths"
    )
    p.add_argument(
        "--activation-checkpointing-mode",
        default="full",
        help="what --checkpoint modules keep: full (default: their inputs), selective (also matrix products and "
        "attention), or operators to keep, comma-separated: aten.mm,aten.addmm",
    )
    p.add_argument(
        "--mixed-precision",
        default=None,
        help="compute dtype, optionally the reduce dtype: bf16, bf16,fp32, none",
    )
    p.add_argument(
        "--cpu-offload",
        nargs="?",
        const=True,
        default=False,
        choices=("optimizer",),
        help="shards, gradients and optimizer state in host memory; '--cpu-offload optimizer': only the "
        "optimizer state",
    )
    p.add_argument(
        "--activation-offload",
        action="store_true",
        help="the units' saved activations in host memory, two units' on the device (needs --wrap and a batch)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help=f"{', '.join(OPTIMIZERS)}, or an optimizer class path (default: adamw)",
    )
    p.add_argument(
        "--shard-group-size", default=None, help="hybrid strategies: ranks per shard group (list allowed)"
    )
    p.add_argument("--no-limit-all-gathers", action="store_true", help="turn the all-gather limiter off")
    p.add_argument(
        "--backward-prefetch", default="BACKWARD_PRE", help="BACKWARD_PRE (default), BACKWARD_POST, none"
    )
    p.add_argument("--forward-prefetch", action="store_true", help="prefetch the next unit in forward")
    p.add_argument(
        "--reshard-root-after-forward",
        action="store_true",
        help="free the root's gathered parameters after forward",
    )
    p.add_argument(
        "--reshard-after-forward",
        default=None,
        help="true, false, or k: keep a copy over k ranks (a node) after forward for backward to gather from",
    )
    p.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per optimizer step (bytes between nodes)"
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node (default: a hybrid shard group, else 8)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per tensor-parallel group, k: the N ranks are a (N/k, k) mesh, the model parallelized over k "
        "and sharded over N/k (default 1)",
    )
    p.add_argument(
        "--tensor-parallel-plan",
        default=None,
        help="module.path:function, a function (model, tp_mesh) -> model calling parallelize_module (default: "
        "the target module's tensor_parallel_plan)",
    )
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="what the peak is for (default cuda)"
    )
    p.add_argument("--bandwidth", default=None, help=f"shard group link: {', '.join(LINKS)} or e.g. 400GB/s")
    p.add_argument(
        "--latency", default=None, help="per ring step, e.g. 5us (default: the preset's, else 5us)"
    )
    p.add_argument("--replicate-bandwidth", default=None, help="replicate group link (hybrid, NO_SHARD)")
    p.add_argument("--replicate-latency", default=None)
    p.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default 400)")
    p.add_argument("--gpu-memory", default=None, help="memory per device (default 80GiB on cuda)")
    p.add_argument(
        "--overhead",
        default=None,
        help="memory outside tensors (default 1GiB on cuda; on cpu the rank's runtime is measured unless given)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _reshard(value: str | None) -> bool | int | None:
    """``--reshard-after-forward``: true / false / an int."""
    if value is None:
        return None
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--reshard-after-forward {value!r} is not true, false or a number of ranks. HINT: e.g. "
            "--reshard-after-forward 8 (the GPUs of one node)."
        ) from None


def run(args: argparse.Namespace) -> int:
    try:
        prefetch = None if args.backward_prefetch.strip().lower() == "none" else args.backward_prefetch
        result = estimate(
            args.target,
            args.world_size,
            sharding_strategy=args.strategy,
            auto_wrap_policy=_policy(args.wrap, "--wrap"),
            activation_checkpointing_policy=_policy(args.checkpoint, "--checkpoint", checkpointing=True),
            activation_checkpointing_mode=_checkpointing_mode(
                args.activation_checkpointing_mode, args.checkpoint
            ),
            mixed_precision=_mixed_precision(args.mixed_precision),
            cpu_offload=args.cpu_offload,
            activation_offload=args.activation_offload,
            optimizer=args.optimizer,
            shard_group_size=args.shard_group_size,
            limit_all_gathers=not args.no_limit_all_gathers,
            backward_prefetch=prefetch,
            forward_prefetch=args.forward_prefetch,
            reshard_root_after_forward=args.reshard_root_after_forward,
            reshard_after_forward=_reshard(args.reshard_after_forward),
            micro_batches=args.micro_batches,
            ranks_per_node=args.ranks_per_node,
            device=args.device,
            bandwidth=args.bandwidth,
            latency=args.latency,
            replicate_bandwidth=args.replicate_bandwidth,
            replicate_latency=args.replicate_latency,
            tflops=args.tflops,
            capacity=args.gpu_memory,
            overhead=args.overhead,
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_plan=args.tensor_parallel_plan,
        )
    except (EstimateError, ValueError, TypeError, ImportError) as err:
        message = str(err)
        if "HINT" not in message:
            message += " HINT: see `flatshard estimate --help` for the accepted values."
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else format_table(result))
    problem = result.diagnosis()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0
