"""The estimator's options, normalised once: world sizes, optimizer, device, links, sizes given as strings.

The sharding options are the strategy's own (:class:`flatshard.ShardOptions` validates them); what is only the
estimator's is here, with one error listing every bad value and a HINT for each.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from flatshard.engine import OptionErrors, ShardingStrategy, ShardOptions

__all__ = [
    "LINKS",
    "OPTIMIZERS",
    "EstimateOptions",
    "Link",
    "parse_bandwidth",
    "parse_bytes",
    "parse_link",
    "parse_seconds",
    "parse_world_sizes",
]


class Link(NamedTuple):
    """A link between ranks: bytes per second each rank sends (one direction) and the latency of one step."""

    name: str
    bandwidth: float  # bytes / s
    latency: float  # s per step of a ring collective


# Per-GPU figures in one direction: NVLink 4 (H100 SXM, 900 GB/s both directions), one 400 Gb/s NDR InfiniBand
# NIC per GPU, one 100 Gb/s Ethernet NIC per GPU.
LINKS: Mapping[str, Link] = MappingProxyType(
    {
        "nvlink": Link("nvlink", 450e9, 2e-6),
        "infiniband": Link("infiniband", 50e9, 5e-6),
        "ethernet": Link("ethernet", 12.5e9, 25e-6),
    }
)

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "muon", "none")

_UNITS = MappingProxyType(
    {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
)


def parse_bytes(value: str | float | int, what: str) -> int:
    """``"80GiB"``, ``"1.5GB"``, ``"512MiB"`` or a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what}={value!r} is negative. HINT: give a size such as 80GiB.")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(value).lower())
    if m is None:
        raise ValueError(f"{what}={value!r} is not a size. HINT: write it like 80GiB, 1.5GB or 512MiB.")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_bandwidth(value: str | float, what: str) -> float:
    """``"400GB/s"``, ``"100Gb/s"`` (bits), ``"25GiB/s"`` -> bytes per second."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{what}={value!r} must be positive. HINT: write it like 400GB/s.")
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT])?(i)?(b|B)(?:ps|/s)\s*", str(value))
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(
            f"{what}={value!r} is not a bandwidth. HINT: write it like 400GB/s (bytes), 400Gb/s (bits), 25GiB/s, "
            f"or name a preset: {', '.join(LINKS)}."
        )
    power = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[(m.group(2) or "").lower()]
    base = 1024.0 if m.group(3) else 1000.0
    bits = m.group(4) == "b"
    return float(m.group(1)) * base**power / (8.0 if bits else 1.0)


def parse_seconds(value: str | float, what: str) -> float:
    """``"5us"``, ``"2ms"``, ``"0.5s"`` or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what}={value!r} is negative. HINT: write it like 5us.")
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ns|us|µs|ms|s)\s*", str(value))
    if m is None:
        raise ValueError(f"{what}={value!r} is not a duration. HINT: write it like 5us, 0.02ms or 1e-5s.")
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def parse_link(bandwidth: str | float | None, latency: str | float | None, what: str) -> Link | None:
    """A preset name or a bandwidth, with an optional latency (a preset's own latency, else 5us)."""
    if bandwidth is None:
        if latency is not None:
            raise ValueError(
                f"{what} latency={latency!r} was given without a bandwidth. HINT: add --bandwidth."
            )
        return None
    preset = LINKS.get(str(bandwidth).strip().lower())
    if preset is not None:
        if latency is None:
            return preset
        return preset._replace(latency=parse_seconds(latency, f"{what} latency"))
    rate = parse_bandwidth(bandwidth, f"{what} bandwidth")
    return Link(
        str(bandwidth), rate, parse_seconds(latency, f"{what} latency") if latency is not None else 5e-6
    )


def parse_world_sizes(value: str | int | Sequence[int]) -> tuple[int, ...]:
    """``8``, ``"8,64,512"`` or ``[8, 64, 512]`` -> sorted, distinct positive ints."""
    items: list[Any]
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int):
        items = [value]  # a bool is refused below
    else:
        items = list(value)
    out = []
    for item in items:
        try:
            n = int(item)
        except (TypeError, ValueError):
            n = 0
        if isinstance(item, bool) or n < 1 or str(n) != str(item).strip():
            raise ValueError(
                f"world size {item!r} is not a positive integer. HINT: pass ranks (GPUs) as integers, e.g. "
                "--world-size 8,64,512."
            )
        out.append(n)
    if not out:
        raise ValueError("no world size given. HINT: pass --world-size N (or a list: 8,64,512).")
    return tuple(sorted(set(out)))


def _check_optimizer(value: object) -> str | type:
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"optimizer must be a name or an optimizer class, got {type(value).__name__}: {value!r}."
        )
    key = value.strip().lower()
    if key in OPTIMIZERS:
        return key
    module_name, _, name = value.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"optimizer={value!r} is neither a known optimizer nor an importable torch.optim.Optimizer class. HINT: "
            f"use one of {', '.join(OPTIMIZERS)} or a class path such as 'torch.optim.Adagrad'."
        )
    return cls


def _check_device(value: object) -> str:
    if value not in ("cuda", "cpu"):
        raise ValueError(
            f"device={value!r} is not a device the estimate is for. HINT: use 'cuda' (GPUs: CUDA context and "
            "the all-gather limiter's lag counted) or 'cpu' (gloo ranks on CPU, as the checks measure)."
        )
    return str(value)


def _check_group_sizes(value: object, strategy: ShardingStrategy | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    elif isinstance(value, str):
        value = tuple(v for v in value.replace(" ", "").split(",") if v)
    out = []
    for v in value:  # type: ignore[attr-defined]
        try:
            n = int(v)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            raise ValueError(
                f"shard group size {v!r} is not a positive integer. HINT: ranks per shard group, usually the GPUs "
                "of one node: --shard-group-size 8."
            )
        out.append(n)
    if out and strategy is not None and not strategy.is_hybrid:
        raise ValueError(
            f"shard group sizes {out} only apply to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {strategy.name}. HINT: "
            "drop --shard-group-size, or pass --strategy HYBRID_SHARD."
        )
    return tuple(sorted(set(out)))


def _check_tensor_parallel(
    opts: EstimateOptions,
    errors: OptionErrors,
    worlds: tuple[int, ...] | None,
    strategy: ShardingStrategy | None,
    optimizer: str | type | None,
) -> None:
    """``tensor_parallel_size``: a positive int dividing every world size, with a plan, a strategy and an
    optimizer that tensor parallelism takes (see [Note: estimating tensor parallelism])."""
    k = opts.tensor_parallel_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        errors.extend(
            ValueError(
                f"tensor_parallel_size={k!r} must be a positive int. HINT: ranks per tensor-parallel group, "
                "usually the GPUs of one node or fewer: --tensor-parallel-size 8."
            )
        )
        return
    if k == 1:
        if opts.tensor_parallel_plan is not None:
            errors.extend(
                ValueError(
                    "a tensor-parallel plan was given without a tensor-parallel size. HINT: add "
                    "--tensor-parallel-size k (tensor_parallel_size=k), or drop the plan."
                )
            )
        return
    for n in worlds or ():
        if n % k:
            errors.extend(
                ValueError(
                    f"tensor-parallel size {k} does not divide world size {n}: the world is a (N/{k}, {k}) mesh. "
                    f"HINT: give world sizes that are multiples of {k}."
                )
            )
    if opts.tensor_parallel_plan is None or not callable(opts.tensor_parallel_plan):
        errors.extend(
            ValueError(
                f"tensor_parallel_size={k} needs a plan, a function (model, tp_mesh) -> model. HINT: pass "
                "tensor_parallel_plan=... (--tensor-parallel-plan module.path:function)."
            )
        )
    if strategy is not None and strategy.is_hybrid:
        errors.extend(
            ValueError(
                f"the estimate of {strategy.name} with tensor parallelism is not supported: it needs a (replicate, "
                "shard, tensor_parallel) mesh. HINT: estimate FULL_SHARD or SHARD_GRAD_OP over the data-parallel "
                "ranks."
            )
        )
    if optimizer == "muon":
        errors.extend(
            ValueError(
                "optimizer 'muon' with tensor parallelism: flatshard refuses whole-tensor optimizers on "
                "tensor-parallel models (each rank holds a piece of every matrix). HINT: use adamw."
            )
        )


@dataclass(frozen=True)
class EstimateOptions:
    """What to estimate, besides the model.

    Args:
        world_sizes: ranks (GPUs) to estimate for, e.g. ``(8, 64, 512)``.
        shard: the sharding options (a :class:`flatshard.ShardOptions`: strategy, wrap policy, mixed
            precision, offload, activation checkpointing, prefetch, ``limit_all_gathers``).
        shard_group_sizes: hybrid strategies: ranks per shard group, one estimate per size (default: 8).
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, ``"muon"`` (Muon for the
            matrices outside embeddings, AdamW for the rest), ``"none"``, or an optimizer class (or its path).
        device: ``"cuda"`` (default) or ``"cpu"``: what the peak is for (see [Note: estimating a step]).
        link: the shard group's link (``None``: no timing); ``replicate_link`` the replicate group's (hybrid,
            NO_SHARD), default the same.
        tflops: achieved compute throughput per rank in TFLOP/s, for the exposed communication time.
        capacity: memory per device in bytes: what "fits" means (default 80 GiB on cuda, none on cpu).
        micro_batches: micro-batches per optimizer step, for the bytes between nodes per step.
        ranks_per_node: ranks per node (default: a hybrid shard group, else 8 or the world size).
        overhead: bytes per device outside tensors (CUDA context, communication buffers); default 1 GiB on
            cuda; on cpu ``None`` (the default) has the rank's runtime measured instead (see [Note: a rank's
            runtime]), and a value replaces the measurement.
        tensor_parallel_size: ranks per tensor-parallel group, ``k``: the world of ``N`` ranks is the mesh
            ``(N/k, k)`` (see [Note: estimating tensor parallelism]). Default: 1 (none).
        tensor_parallel_plan: with ``tensor_parallel_size`` above 1, the function ``(model, tp_mesh) -> model``
            that parallelizes the model.
    """

    world_sizes: tuple[int, ...]
    shard: ShardOptions = field(default_factory=ShardOptions)
    shard_group_sizes: tuple[int, ...] = ()
    optimizer: str | type = "adamw"
    device: str = "cuda"
    link: Link | None = None
    replicate_link: Link | None = None
    tflops: float = 400.0
    capacity: int | None = None
    overhead: int | None = None
    micro_batches: int = 1
    ranks_per_node: int | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_plan: Any = None

    def __post_init__(self) -> None:
        errors = OptionErrors("estimate")
        worlds = errors.check(parse_world_sizes, self.world_sizes)
        strategy = self.shard.sharding_strategy if isinstance(self.shard, ShardOptions) else None
        if not isinstance(self.shard, ShardOptions):
            errors.extend(TypeError(f"shard must be a ShardOptions, got {type(self.shard).__name__}."))
        sizes = errors.check(_check_group_sizes, self.shard_group_sizes, strategy)
        optimizer = errors.check(_check_optimizer, self.optimizer)
        device = errors.check(_check_device, self.device)
        if isinstance(self.tflops, bool) or not isinstance(self.tflops, (int, float)) or self.tflops <= 0:
            errors.extend(
                ValueError(
                    f"tflops={self.tflops!r} must be a positive number. HINT: e.g. 400 for an H100 in bf16."
                )
            )
        if strategy is not None and strategy.is_hybrid and worlds and sizes is not None:
            for n in worlds:
                for k in sizes or (min(8, n),):
                    if n % k:
                        errors.extend(
                            ValueError(
                                f"shard group size {k} does not divide world size {n}. HINT: use a divisor of every "
                                "world size (the GPUs of one node, usually 8)."
                            )
                        )
        for name in ("micro_batches", "ranks_per_node"):
            value = getattr(self, name)
            if value is None and name == "ranks_per_node":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                errors.extend(
                    ValueError(
                        f"{name}={value!r} must be a positive int. HINT: e.g. 4 micro-batches per optimizer step, "
                        "8 ranks per node."
                    )
                )
        _check_tensor_parallel(self, errors, worlds, strategy, optimizer)
        if isinstance(self.shard, ShardOptions) and self.shard.cpu_offload and device == "cpu":
            errors.extend(
                ValueError(
                    "cpu_offload with device='cpu' has nothing to offload to. HINT: use device='cuda'."
                )
            )
        errors.raise_if_any()
        object.__setattr__(self, "world_sizes", worlds)
        object.__setattr__(self, "shard_group_sizes", sizes)
        object.__setattr__(self, "optimizer", optimizer)
        if self.replicate_link is None:
            object.__setattr__(self, "replicate_link", self.link)
        if self.capacity is None and device == "cuda":
            object.__setattr__(self, "capacity", 80 * 2**30)
        if self.overhead is None and device == "cuda":
            object.__setattr__(self, "overhead", 2**30)  # cpu: None, the runtime is measured

    def group_sizes_for(self, world: int) -> tuple[int | None, ...]:
        """The shard group sizes to estimate at ``world`` ranks (``(None,)`` for non-hybrid strategies)."""
        if not self.shard.sharding_strategy.is_hybrid:
            return (None,)
        return self.shard_group_sizes or (min(8, world),)
