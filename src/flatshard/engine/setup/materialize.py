"""Meta-device (deferred) init: modules built on the meta device are materialized one unit at a time.

[Note: materializing unit by unit]
``shard()`` walks the planned units in order. Before a unit's flat parameter is built, every module that
directly holds one of the unit's parameters gets real, uninitialized storage on the target device
(``module.to_empty(recurse=False)``) and is initialized in place, by ``param_init_fn(module)`` or else
by the module's own ``reset_parameters()``. Materialization makes new ``Parameter`` objects, so the unit
re-acquires each parameter by its ``(module, name)`` and re-ties shared parameters to the first holder's
tensor. The unit is then sharded and its full tensors freed before the next unit is touched: at most
the shards done so far plus one unit's full parameters (and its flat copy) exist at any time.
On CPU those transient full tensors, and the shards, are large blocks in mappings of their own: freed
heap blocks would stay with the process (glibc does not hand them back or reuse them reliably for this
pattern), and peak RSS would grow by the whole model after all. Measured on 16 x 16 MiB linears on 2
ranks: RSS grows by 0.64x the model with mappings, 1.5x with heap blocks.

Each module gets its values from the first that applies: ``param_init_fn(module)``; inside a Hugging Face
``PreTrainedModel``, the model's own ``_init_weights(module)`` for the buffers (rotary ``inv_freq`` as
``from_pretrained`` computes it), the parameters left for a checkpoint; the module's ``reset_parameters()``
(called, as torch FSDP does, on each module holding parameters or buffers of its own); a peft LoRA adapter's
weights, inside a Hugging Face model or not, get peft's own ``reset_lora_parameters`` (B zero), called once
the unit's adapter weights all have storage. A parameter or buffer none of them writes is not made zeros: it is *unfilled*
(see [Note: unfilled tensors]); an unfilled parameter keeps no full storage when nothing needs it (the
unit's shard is built from pieces), so a model that ``load_pretrained`` fills never exists in full on
any rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.setup.wrap import UnitPlan
from flatshard.engine.transport import memory
from flatshard.engine.unfilled import BufferMark, fill_marker, holds_marker

__all__ = [
    "Adapter",
    "Initializers",
    "Materialized",
    "ParamInitFn",
    "has_meta_tensors",
    "hf_owners",
    "materialize_modules",
    "materialize_unit",
]

ParamInitFn = Callable[[nn.Module], None]


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(t.is_meta for t in tensors)


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized storage like ``t`` on ``device``; large CPU tensors get a mapping of their own, which is
    returned to the system the moment the unit is sharded and the tensor freed."""
    if device.type == "cpu":
        return memory.empty_mapped(t.shape, t.dtype)
    return torch.empty_like(t, device=device)


def hf_owners(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module under ``root`` inside a Hugging Face ``PreTrainedModel``: the innermost such model."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if base is None:
        return {}
    owners: dict[nn.Module, nn.Module] = {}

    def walk(m: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(m, base):
            owner = m
        if owner is not None:
            owners[m] = owner
        for child in m.children():
            walk(child, owner)

    walk(root, None)
    return owners


_ADAPTER_ATTRS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
_ADAPTER_INITS = (True, False, "gaussian")  # peft initializations that do not read the base weights


@dataclass(frozen=True)
class Adapter:
    """A peft LoRA layer's adapter whose weights a module holds, and how peft initializes them."""

    layer: nn.Module
    name: str
    init: Any


def adapters_of(root: nn.Module) -> dict[nn.Module, list[Adapter]]:
    """The modules under ``root`` holding peft LoRA adapter weights, with their layer and adapter names."""
    out: dict[nn.Module, list[Adapter]] = {}

    def walk(m: nn.Module, configs: Any) -> None:
        configs = (
            getattr(m, "peft_config", None) if isinstance(getattr(m, "peft_config", None), dict) else configs
        )
        if hasattr(m, "reset_lora_parameters"):
            for attr in _ADAPTER_ATTRS:
                container = getattr(m, attr, None)
                if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
                    for key in container.keys():
                        init = getattr((configs or {}).get(key), "init_lora_weights", True)
                        holders = (
                            container[key].modules() if isinstance(container, nn.ModuleDict) else [container]
                        )
                        for holder in holders:
                            out.setdefault(holder, []).append(Adapter(m, key, init))
        for child in m.children():
            walk(child, configs)

    walk(root, None)
    return out


@dataclass(frozen=True)
class Initializers:
    """Where the values of a meta-built model's modules come from, besides ``param_init_fn`` and
    ``reset_parameters`` (see the module note)."""

    hf: dict[nn.Module, nn.Module] = field(default_factory=dict)  # module -> its Hugging Face model
    adapters: dict[nn.Module, list[Adapter]] = field(default_factory=dict)  # module -> peft adapters it holds

    @classmethod
    def of(cls, root: nn.Module) -> Initializers:
        return cls(hf_owners(root), adapters_of(root))


@dataclass
class Materialized:
    """What materializing left unfilled (see [Note: unfilled tensors]): parameters by identity, buffers."""

    params: set[int] = field(
        default_factory=set
    )  # id() of unfilled parameters (on meta, or holding the marker)
    buffers: list[BufferMark] = field(default_factory=list)


def _written(module: nn.Module, attr: str, before: torch.Tensor, version: int, table: str) -> bool:
    now = getattr(module, table).get(attr)
    if now is None:
        return True  # removed: nothing to fill
    return now is not before or now._version != version or (not now.is_meta and not holds_marker(now))


def materialize_modules(
    modules: Iterable[nn.Module],
    device: torch.device,
    init_fn: ParamInitFn | None,
    names: dict[nn.Module, str],
    inits: Initializers,
    out: Materialized,
    keep_meta: bool = True,
) -> None:
    """Give each module's own meta tensors storage on ``device`` and values (see the module note); record
    in ``out`` what stays unfilled. ``keep_meta``: unfilled parameters keep no storage (else they get
    storage holding the marker, for a broadcast to fill)."""
    written: list[
        tuple[nn.Module, dict[tuple[str, str], tuple[torch.Tensor, int]], dict[str, nn.Parameter]]
    ] = []
    adapters: dict[tuple[int, str], Adapter] = {}  # peft adapters to initialize once their weights exist
    for module in modules:
        own_params = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        own_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not own_params and not own_buffers:
            continue
        owner = inits.hf.get(module)
        peft = inits.adapters.get(module, []) if init_fn is None else []
        hf = init_fn is None and owner is not None and not peft
        by_reset = init_fn is None and not hf and not peft and hasattr(module, "reset_parameters")
        fill_params = init_fn is not None or by_reset or bool(peft)
        for attr in own_buffers:
            buf = module._buffers[attr]
            assert buf is not None
            module._buffers[attr] = _empty_like(buf, device)
        if fill_params or not keep_meta:
            for attr in own_params:
                p = module._parameters[attr]
                assert p is not None
                module._parameters[attr] = nn.Parameter(_empty_like(p, device), requires_grad=p.requires_grad)
        before: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        for table in ("_parameters", "_buffers"):
            for attr, t in getattr(module, table).items():
                if t is not None and (attr in own_params or attr in own_buffers) and not t.is_meta:
                    fill_marker(t)
                    before[(table, attr)] = (t, t._version)
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            elif hf:
                assert owner is not None
                owner._init_weights(module)  # type: ignore[operator]
            elif by_reset:
                module.reset_parameters()  # type: ignore[operator]
        for adapter in peft:
            adapters[(id(adapter.layer), adapter.name)] = adapter
        written.append((module, before, own_params))
    with torch.no_grad():
        for adapter in adapters.values():  # after all its weights exist: it sets A and B together
            if adapter.init not in _ADAPTER_INITS:
                raise ValueError(
                    f"peft's init_lora_weights={adapter.init!r} ({names.get(adapter.layer, '?')!r}) computes the "
                    "adapter from the base weights, which a meta-built model does not have yet. HINT: create the "
                    "adapter with init_lora_weights=True or 'gaussian', or apply peft after the weights are loaded."
                )
            adapter.layer.reset_lora_parameters(adapter.name, adapter.init)  # type: ignore[operator]
    for module, before, own_params in written:
        where = names.get(module, "?")
        for (table, attr), (t, version) in before.items():
            if _written(module, attr, t, version, table):
                continue
            if table == "_buffers":
                out.buffers.append(BufferMark(module, attr, _join(where, attr), t, t._version))
            else:
                out.params.add(id(t))
        for attr, p in own_params.items():
            if module._parameters.get(attr) is p:  # left on the meta device: unfilled, no storage
                out.params.add(id(p))
        still = [n for n, t in module._buffers.items() if t is not None and t.is_meta]
        still += [
            n
            for n, t in module._parameters.items()
            if t is not None and t.is_meta and own_params.get(n) is not t
        ]
        if still:
            raise ValueError(
                f"{type(module).__name__} ({where!r}) still has meta tensors {still} after initialization. HINT: "
                "param_init_fn must initialize the module's tensors in place (or call "
                "module.to_empty(device=..., recurse=False) itself)."
            )


def _join(prefix: str, attr: str) -> str:
    return attr if prefix in ("", "<root>") else f"{prefix}.{attr}"


def materialize_unit(
    plan: UnitPlan,
    device: torch.device,
    init_fn: ParamInitFn | None,
    names: dict[nn.Module, str],
    inits: Initializers,
    out: Materialized,
    keep_meta: bool = True,
) -> None:
    """Materialize the modules holding ``plan``'s parameters and re-acquire them by name, in place."""
    holders: list[nn.Module] = []
    for aliases in plan.aliases:
        for module, _ in aliases:
            if module not in holders:
                holders.append(module)
    materialize_modules(holders, device, init_fn, names, inits, out, keep_meta)
    for i, aliases in enumerate(plan.aliases):
        first_module, first_name = aliases[0]
        param = first_module._parameters[first_name]
        assert param is not None
        for module, name in aliases[1:]:
            module._parameters[name] = param  # re-tie: each holder got its own tensor from to_empty
        plan.params[i] = param
