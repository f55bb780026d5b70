"""Checkpoint names that Hugging Face models load under other names, or as parts of other tensors.

[Note: transformers' weight conversions]
transformers (5.x) loads some checkpoints through a *conversion mapping* declared per model type
(``transformers.conversion_mapping.get_model_conversion_mapping``, the list ``from_pretrained`` itself uses):

- *renamings*: ``embed_out.weight`` is ``lm_head.weight`` in GPT-NeoX, ``block_sparse_moe`` is ``mlp`` in
  Mixtral, ``LayerNorm.gamma`` is ``LayerNorm.weight`` in old checkpoints;
- *converters*: several checkpoint tensors make one parameter, or one makes several. Mixtral, Qwen2-MoE,
  DeepSeek and the other mixtures of experts keep one ``experts.N.w1.weight`` per expert in their checkpoints,
  where the model holds all experts in one 3-D ``experts.gate_up_proj``.

:func:`conversions` asks transformers for that mapping and applies it to the checkpoint's names, with
transformers' own functions, so a checkpoint loads under exactly the names ``from_pretrained`` gives it. A
renamed tensor is read like any other (each rank its own byte range). A converted one cannot be: its bytes are
the result of transformers' operations on whole tensors, so a rank whose shard holds part of it reads those
checkpoint tensors whole, lets the converter build the parameter, and keeps its range (one converted parameter
at a time: a rank holds at most its sources and the result besides its shard). Before anything is read, every
converter runs on meta tensors, which gives each converted parameter's shape for the usual checks.

Without transformers, without a conversion mapping (transformers 4.x), or for a module holding no Hugging Face
model, nothing is renamed or converted.
"""

from __future__ import annotations

import copy
import functools
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.hf_source import SourceTensor

__all__ = ["Conversions", "ConvertedGroup", "Reverted", "conversions", "reverted"]


@dataclass
class ConvertedGroup:
    """Checkpoint tensors that one converter turns into one or more of the model's tensors."""

    first: str  # the model name (prefix taken off) transformers files the group under
    converter: Any  # a transformers ``WeightConverter`` of its own (a deep copy), sources not yet added
    model: nn.Module  # the Hugging Face model, handed to operations that ask for it (and its config)
    sources: list[tuple[str, SourceTensor]] = field(default_factory=list)  # (source pattern, tensor)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model name -> shape, from a dry run

    def convert(self, load: Callable[[SourceTensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the converter on the source tensors (``load`` gives each whole, when the converter asks for it):
        ``{model name: tensor}``."""
        converter = copy.deepcopy(self.converter)
        for pattern, tensor in self.sources:
            converter.add_tensor(self.first, tensor.name, pattern, functools.partial(load, tensor))
        with torch.no_grad():
            out = converter.convert(self.first, model=self.model, config=getattr(self.model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

    def sources_names(self) -> list[str]:
        return [t.name for _, t in self.sources]

    def dry_run(self) -> None:
        """Fill :attr:`shapes` by converting meta tensors of the sources' shapes."""
        out = self.convert(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
        self.shapes = {name: tuple(value.shape) for name, value in out.items()}


@dataclass
class Conversions:
    """What :func:`conversions` found: checkpoint names by model name, for renamed and converted tensors."""

    renamed: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint name
    groups: dict[str, ConvertedGroup] = field(default_factory=dict)  # model name -> its group (all targets)
    unmatched: set[str] = field(default_factory=set)  # converter sources whose target the model lacks


def _hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face ``PreTrainedModel`` in ``module`` (``module`` itself, a LightningModule's
    ``self.model``, a peft model's base)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if base is None:
        return None
    return next((m for m in module.modules() if isinstance(m, base)), None)


def _mapping_functions() -> tuple[Any, Any, Any, Any] | None:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers 4.x loads names as they are stored
        return None
    return get_model_conversion_mapping, (WeightRenaming, WeightConverter), rename_source_key, dot_natural_key


def conversions(
    module: nn.Module, model_names: Iterable[str], tensors: dict[str, SourceTensor]
) -> Conversions:
    """The renamings and conversions transformers applies to the checkpoint ``tensors`` for the Hugging Face model
    in ``module`` (see [Note: transformers' weight conversions]). ``model_names`` are the module's names as the
    checkpoint would hold them (prefix taken off); names the checkpoint holds as they are are left alone.

    Raises:
        CheckpointError: a converter fails on the checkpoint's tensors (shapes it cannot combine).
    """
    found = Conversions()
    hf_model = _hf_model(module)
    functions = _mapping_functions() if hf_model is not None else None
    if functions is None or hf_model is None:
        return found
    get_mapping, (renaming_cls, converter_cls), rename, natural_key = functions
    try:
        mapping = get_mapping(hf_model)
    except Exception:  # a model transformers does not describe (custom code): names as they are
        return found
    renamings = [m for m in mapping if isinstance(m, renaming_cls)]
    converters = [m for m in mapping if isinstance(m, converter_cls)]
    if not renamings and not converters:
        return found
    names = set(model_names)
    present = dict.fromkeys(names, True)  # what transformers' helper asks: does the model have this name
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(hf_model, "base_model_prefix", None) or None
    for key in sorted(tensors, key=natural_key):  # transformers adds each converter's sources in this order
        if key in names:
            continue  # stored under the model's own name
        target, pattern = rename(key, renamings, converters, prefix, present)
        if target not in names:
            if pattern is not None:
                found.unmatched.add(key)
            continue
        if pattern is None:
            found.renamed.setdefault(target, key)
            continue
        group = found.groups.get(target)
        if group is None:
            group = found.groups[target] = ConvertedGroup(
                target, copy.deepcopy(by_pattern[pattern]), hf_model
            )
        group.sources.append((pattern, tensors[key]))
    for group in list({id(g): g for g in found.groups.values()}.values()):
        try:
            group.dry_run()
        except Exception as err:
            raise CheckpointError(
                f"transformers' conversion of {', '.join(t.name for _, t in group.sources[:4])} into "
                f"{group.first!r} failed ({type(err).__name__}: {_first_line(err)}). HINT: build the model from "
                "the checkpoint's own config.json. Nothing was loaded."
            ) from err
        for name in group.shapes:  # a converter that makes several tensors files each under its own name
            if name in names:
                found.groups[name] = group
    return found


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return re.split(r"\n", text, maxsplit=1)[0][:300] if text else "no message"


# ---------------------------------------------------------------------------------------------- writing back
@dataclass
class _ReverseGroup:
    """Model tensors that one reversed transform turns back into the checkpoint's tensors."""

    transform: Any  # a reversed WeightConverter or WeightRenaming of its own
    first: str  # the name transformers files the group under
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (model name, source pattern), in order
    arrived: dict[str, torch.Tensor] = field(default_factory=dict)

    def convert(
        self, tensors: dict[str, torch.Tensor], model: nn.Module, renamings: list[Any]
    ) -> dict[str, Any]:
        transform = copy.deepcopy(self.transform)
        for name, pattern in self.inputs:
            transform.add_tensor(self.first, name, pattern, tensors[name])
        with torch.no_grad():
            out = transform.convert(self.first, model=model, config=getattr(model, "config", None))
        rename = _mapping_functions_rename()
        return {
            rename(name, renamings): value[0] if isinstance(value, list) else value
            for name, value in out.items()
        }


def _mapping_functions_rename() -> Any:
    from transformers.core_model_loading import apply_renamings

    return apply_renamings


@dataclass
class Reverted:
    """The checkpoint layout transformers' own ``save_pretrained`` writes for a model's tensors (see [Note:
    transformers' weight conversions]): what :func:`reverted` plans, then :meth:`put` turns the model's tensors,
    as they arrive, into the tensors to write."""

    model: nn.Module
    renamings: list[Any]
    groups: dict[str, _ReverseGroup]  # model name -> its group
    outputs: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]  # group first -> what it writes

    def put(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors to write once ``name`` arrived: none until its group is complete."""
        group = self.groups[name]
        if len(group.inputs) == 1:
            return list(group.convert({name: tensor}, self.model, self.renamings).items())
        group.arrived[name] = tensor
        if len(group.arrived) < len(group.inputs):
            return []
        arrived, group.arrived = group.arrived, {}
        return list(group.convert(arrived, self.model, self.renamings).items())


def reverted(
    module: nn.Module, prefix: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> Reverted | None:
    """How transformers' ``save_pretrained`` would name and lay out ``specs`` (the model's tensors, names with
    ``prefix`` taken off), or ``None`` where it writes them as they are: no Hugging Face model at ``prefix``, no
    conversion mapping, or nothing it changes.

    Raises:
        CheckpointError: a reversed converter fails on the model's shapes.
    """
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    hf_model = None
    for path, m in module.named_modules():
        if base is not None and isinstance(m, base):
            hf_model = m if (path + "." if path else "") == prefix else None
            break
    functions = _mapping_functions() if hf_model is not None else None
    if functions is None or hf_model is None:
        return None
    get_mapping, (renaming_cls, converter_cls), _, natural_key = functions
    try:
        from transformers.core_model_loading import PrefixChange, apply_converters, apply_renamings

        mapping = [m for m in get_mapping(hf_model, add_legacy=False) if not isinstance(m, PrefixChange)]
    except Exception:  # a model transformers does not describe: names as they are
        return None
    reverse = [m.reverse_transform() for m in mapping[::-1]]  # as transformers' revert_weight_conversion
    renamings = [m for m in reverse if isinstance(m, renaming_cls)]
    converters = [m for m in reverse if isinstance(m, converter_cls)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, _ReverseGroup] = {}
    firsts: dict[str, _ReverseGroup] = {}
    changed = False
    for name, _, _ in sorted(specs, key=lambda s: natural_key(s[0])):
        target, pattern = apply_converters(name, converters)
        if pattern is None:
            target = apply_renamings(name, renamings)
            group = firsts.setdefault(target, _ReverseGroup(renaming_cls(name, target), target))
            changed = changed or target != name
            pattern = name
        else:
            group = firsts.setdefault(target, _ReverseGroup(copy.deepcopy(by_pattern[pattern]), target))
            changed = True
        group.inputs.append((name, pattern))
        groups[name] = group
    if not changed:
        return None
    dtypes = {name: (dtype, shape) for name, dtype, shape in specs}
    outputs: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
    for group in firsts.values():
        metas = {n: torch.empty(dtypes[n][1], dtype=dtypes[n][0], device="meta") for n, _ in group.inputs}
        try:
            out = group.convert(metas, hf_model, renamings)
        except Exception as err:
            raise CheckpointError(
                f"transformers' reversed conversion of {group.first!r} (from "
                f"{', '.join(n for n, _ in group.inputs[:3])}) failed ({type(err).__name__}: {_first_line(err)})."
            ) from err
        outputs[group.first] = [(n, v.dtype, tuple(v.shape)) for n, v in out.items()]
    return Reverted(hf_model, renamings, groups, outputs)
