"""How a sharded checkpoint names its entries, and how a flat range of a tensor maps to n-d boxes.

[Note: DCP-native layout]
Since format version 2 a flatshard sharded checkpoint is laid out the way torch's own sharded state dicts
are, so the other ``torch.distributed.checkpoint`` readers understand it and flatshard understands theirs:

- **Global shapes.** Every tensor is stored under its full shape. A rank holds a contiguous range of the
  *flattened* parameter (see [Note: sharded state]) and writes that range as the few n-d boxes it decomposes
  into (:func:`flat_boxes`): for a matrix a partial leading row, a block of whole rows and a partial trailing
  row; the same recursively for more dimensions, at most ``2 * ndim - 1`` boxes. No byte moves between ranks.
  A reader asks for the boxes of *its* range, and DCP cuts them out of whatever chunks were stored (row
  blocks from FSDP1 and FSDP2, flatshard boxes from any world size, whole tensors).
- **Lightning's keys.** ``<model>.<state-dict key>``, ``<optimizer>.state.<parameter name>.<state key>`` and
  ``<optimizer>.param_groups.<i>.<field>``, as torch flattens ``{"model": ..., "optimizer_0": ...}``: ``model`` and
  ``optimizer_<k>`` from the Trainer (as Lightning's ``FSDPStrategy`` writes), the state's own names from
  Fabric. The metadata's ``planner_data`` records each key's path, as torch's flattening does, so
  ``dcp_to_torch_save`` and ``load_sharded_optimizer_state_dict`` read the directory.
- **The rest.** The remaining checkpoint entries (Lightning's epoch, loops, callbacks) are the object entry
  ``flatshard.extra`` and, for Lightning's own strategies, the file ``meta.pt`` beside the data files;
  ``flatshard.meta`` holds the format name and version, the writer's world size and versions, the model's
  keys in order, tied-parameter aliases and the names above.
- **Tied parameters** are stored under each of their names, so every reader finds every key; flatshard reads
  the first.
- **Pieces in the rest.** A :class:`~flatshard.engine.ParamShard` anywhere in the other entries (the
  ``ShardedEMA`` callback's weights) is stored like a parameter, under ``flatshard.pieces.<path>``, and the
  entry keeps a :class:`StoredPiece` in its place. A loading rank reads its own piece of it when the path ends
  in a model key whose parameter it shares (cut like that parameter), the whole tensor otherwise;
  consolidation reads it whole.

Reading recognises three layouts (:class:`Layout`): version 1 (flat 1-D pieces under ``model/<key>``,
still loaded), version 2, and *foreign* DCP checkpoints without ``flatshard.meta`` (torch FSDP1
``SHARDED_STATE_DICT``, FSDP2 / ``get_state_dict``, Lightning's FSDP and ModelParallel strategies, Fabric).
A foreign model's prefix is found by matching the model's own keys against the stored ones (``model.``,
``state_dict.``, a Fabric state's name, or none); its extra state is ``meta.pt`` when there is one. Names
are compared with torch's wrapper segments (``_orig_mod.``, ``_checkpoint_wrapped_module.``,
``_fsdp_wrapped_module.``) removed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

__all__ = [
    "LIGHTNING_META",
    "Box",
    "Layout",
    "Names",
    "StoredPiece",
    "canonical",
    "fill_pieces",
    "find_pieces",
    "flat_boxes",
    "foreign_layout",
    "group_root",
    "optimizer_state_entries",
    "shard_boxes",
    "split_pieces",
    "unclaimed_keys",
]

LIGHTNING_META = "meta.pt"  # Lightning's strategies keep a sharded checkpoint's other entries here
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_MODEL_PREFIXES = ("model.", "state_dict.", "module.", "")


# ---------------------------------------------------------------------------------------------- boxes
@dataclass(frozen=True)
class Box:
    """An n-d block of a tensor that is contiguous in its flattened form.

    Attributes:
        offsets: the block's first index in every dimension.
        sizes: its extent in every dimension.
        start: the flat index of its first element.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes, in order, that cover the flat range ``[start, stop)`` of a row-major tensor of ``shape``.

    Each box is contiguous in the flattened tensor, so it is a view of the range's own memory. At most
    ``2 * len(shape) - 1`` boxes (one for a 0-d tensor); none for an empty range.
    """
    dims = tuple(int(d) for d in shape)
    out: list[Box] = []
    if stop <= start:
        return out
    if not dims:
        return [Box((), (), 0)]

    def cover(prefix: tuple[int, ...], rest: tuple[int, ...], base: int, a: int, b: int) -> None:
        """Cover ``[a, b)`` (relative to ``base``) of the sub-tensor at index ``prefix``, of shape ``rest``."""
        if a >= b:
            return
        lead = (1,) * len(prefix)
        if len(rest) == 1:
            out.append(Box((*prefix, a), (*lead, b - a), base + a))
            return
        inner = 1
        for d in rest[1:]:
            inner *= d
        r0, c0 = divmod(a, inner)
        r1, c1 = divmod(b, inner)
        if r0 == r1:  # within one row
            cover((*prefix, r0), rest[1:], base + r0 * inner, c0, c1)
            return
        if c0:  # a partial leading row
            cover((*prefix, r0), rest[1:], base + r0 * inner, c0, inner)
            r0 += 1
        if r1 > r0:  # whole rows
            zeros = (0,) * (len(rest) - 1)
            out.append(Box((*prefix, r0, *zeros), (*lead, r1 - r0, *rest[1:]), base + r0 * inner))
        if c1:  # a partial trailing row
            cover((*prefix, r1), rest[1:], base + r1 * inner, 0, c1)

    cover((), dims, 0, start, stop)
    return out


def shard_boxes(shard: Any) -> list[Box]:
    """The boxes of the full tensor that a :class:`~flatshard.engine.ParamShard` covers: of its flat range, within
    its tensor-parallel block when it has one (``start`` stays relative to the piece's own flattening)."""
    n = shard.local.numel()
    if shard.block is None:
        return flat_boxes(shard.shape, shard.offset, shard.offset + n)
    at, sizes = shard.block
    return [
        Box(tuple(o + a for o, a in zip(b.offsets, at, strict=True)), b.sizes, b.start)
        for b in flat_boxes(sizes, shard.offset, shard.offset + n)
    ]


# ---------------------------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class StoredPiece:
    """In a checkpoint's other entries: a tensor stored sharded, as the DCP entry ``fqn`` of ``shape``."""

    fqn: str
    shape: tuple[int, ...]


def split_pieces(
    extra: Mapping[str, Any], piece_type: type
) -> tuple[dict[str, Any], list[tuple[tuple[Any, ...], Any]]]:
    """``extra`` with every ``piece_type`` value (in nested dicts) replaced by a :class:`StoredPiece`, and the
    ``(path, piece)`` pairs taken out; one object found under several paths is stored once."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    seen: dict[int, StoredPiece] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, piece_type):
            if id(value) not in seen:
                fqn = ".".join(map(str, ("flatshard", "pieces", *path)))
                seen[id(value)] = StoredPiece(fqn, tuple(cast(Any, value).shape))
                found.append((path, value))
            return seen[id(value)]
        if isinstance(value, Mapping) and not isinstance(value, StoredPiece):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        return value

    return walk(dict(extra), ()), found


def find_pieces(extra: Mapping[str, Any]) -> list[tuple[tuple[Any, ...], StoredPiece]]:
    """The ``(path, StoredPiece)`` pairs of a checkpoint's other entries, as read."""
    out: list[tuple[tuple[Any, ...], StoredPiece]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, StoredPiece):
            out.append((path, value))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, (*path, k))

    walk(extra, ())
    return out


def fill_pieces(extra: Any, values: Mapping[str, Any]) -> Any:
    """``extra`` with each :class:`StoredPiece` replaced by ``values[its fqn]``."""
    if isinstance(extra, StoredPiece):
        return values[extra.fqn]
    if isinstance(extra, Mapping):
        return {k: fill_pieces(v, values) for k, v in extra.items()}
    return extra


# ---------------------------------------------------------------------------------------------- names
def canonical(name: str) -> str:
    """A state-dict key or parameter name without torch's wrapper segments (``_orig_mod.``...)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@dataclass(frozen=True)
class Names:
    """The names a checkpoint's model and optimizers are stored under (see [Note: DCP-native layout])."""

    model: str = "model"
    optimizers: tuple[str, ...] = ()

    def optimizer(self, k: int) -> str:
        return self.optimizers[k] if k < len(self.optimizers) else f"optimizer_{k}"


@dataclass
class Layout:
    """Where one checkpoint keeps each part, by DCP key (see [Note: DCP-native layout]).

    Attributes:
        version: the flatshard format version, or 0 for a checkpoint another tool wrote.
        model: state-dict key -> DCP key, in the saved order (tied aliases map to their first key's entry).
        aliases: tied key -> the key whose entry holds it.
        optimizers: per optimizer, the root of its ``param_groups`` (one object entry of that name, or one
            entry per group or parameter and field under it) and ``{DCP key: (parameter name, state key)}`` of
            its state.
        extra_key: the object entry holding the rest of the checkpoint, if any (else ``meta.pt`` or nothing).
        saved_optimizers: whether optimizer states were saved at all (a list, possibly empty).
        unclaimed: keys stored under the model's name (relative to it) that no key of the model maps to (for
            flatshard's layouts: that the saved key list does not name); strict loading refuses them.
    """

    version: int
    model: dict[str, str] | None
    aliases: dict[str, str] = field(default_factory=dict)
    optimizers: list[tuple[str, dict[str, tuple[str, str]]]] = field(default_factory=list)
    extra_key: str | None = None
    saved_optimizers: bool = True  # False: the checkpoint holds no optimizer states at all
    unclaimed: list[str] = field(default_factory=list)

    @property
    def num_optimizers(self) -> int | None:
        """How many optimizer states the checkpoint holds; ``None`` if it was saved without any."""
        return len(self.optimizers) if self.saved_optimizers else None


def optimizer_state_entries(entries: Iterable[str], prefix: str) -> dict[str, tuple[str, str]]:
    """``{DCP key: (parameter name, state key)}`` of the ``<prefix>state.<name>.<key>`` entries."""
    head = prefix + "state."
    out: dict[str, tuple[str, str]] = {}
    for fqn in entries:
        if fqn.startswith(head):
            name, _, key = fqn[len(head) :].rpartition(".")
            if name:
                out[fqn] = (name, key)
    return out


def unclaimed_keys(entries: Iterable[str], prefix: str, known: Collection[str]) -> list[str]:
    """The keys stored under ``prefix`` (relative to it) that are not in ``known``."""
    return [f[len(prefix) :] for f in entries if f.startswith(prefix) and f[len(prefix) :] not in known]


def group_root(fqn: str) -> str | None:
    """``<optimizer>.param_groups`` for an entry of an optimizer's param groups (whole, or one field)."""
    head, found, rest = fqn.partition("param_groups")
    if found and (not head or head.endswith(".")) and (not rest or rest.startswith(".")):
        return head + found
    return None


def foreign_layout(
    entries: Mapping[str, Any],
    module_keys: Sequence[str] | None,
    names: Names | None,
    num_optimizers: int | None,
) -> Layout:
    """The layout of a DCP checkpoint another tool wrote, found from its keys (see [Note: DCP-native layout]).

    ``module_keys``: the loading model's state-dict keys (the prefix that finds most of them wins); without
    them (consolidation) the first of ``model.`` / ``state_dict.`` that holds entries. ``names``: the loading
    Fabric state's names, tried first. ``num_optimizers``: how many optimizers to look for (``None``: as many
    ``optimizer_<k>`` as there are).
    """
    keys = list(entries)
    candidates = ([names.model + "."] if names is not None and names.model else []) + list(_MODEL_PREFIXES)
    candidates = list(dict.fromkeys(candidates))
    model: dict[str, str] | None = None
    wanted: dict[str, str] = {}
    model_prefix = ""
    if module_keys is not None:
        wanted = {canonical(k): k for k in module_keys}
        best: dict[str, str] = {}
        for prefix in candidates:
            found: dict[str, str] = {}
            for fqn in keys:
                if fqn.startswith(prefix):
                    own = wanted.get(canonical(fqn[len(prefix) :]))
                    if own is not None:
                        found.setdefault(own, fqn)
            if len(found) > len(best):
                best, model_prefix = found, prefix
        model = {k: best[k] for k in module_keys if k in best}
    else:
        for prefix in candidates[:-1]:  # never the empty prefix: it would take every entry as the model's
            found = {fqn[len(prefix) :]: fqn for fqn in keys if fqn.startswith(prefix)}
            if found:
                model = found
                break
    optimizers: list[tuple[str, dict[str, tuple[str, str]]]] = []
    roots = {group_root(fqn) for fqn in keys} - {None}
    k = 0
    while num_optimizers is None or k < num_optimizers:
        tried = [names.optimizer(k)] if names is not None else []
        tried.append(f"optimizer_{k}")
        if k == 0 and num_optimizers == 1:
            tried += ["optimizer", "optim", "optimizers", ""]
        prefixes = [p + "." if p else "" for p in dict.fromkeys(tried)]
        found_prefix = next((p for p in prefixes if p + "param_groups" in roots), None)
        if found_prefix is None:
            break
        optimizers.append((found_prefix + "param_groups", optimizer_state_entries(keys, found_prefix)))
        k += 1
    unclaimed = _foreign_unclaimed(keys, model_prefix, wanted, optimizers) if model else []
    return Layout(
        version=0, model=model, optimizers=optimizers, saved_optimizers=bool(optimizers), unclaimed=unclaimed
    )


def _foreign_unclaimed(
    keys: Sequence[str],
    prefix: str,
    wanted: Mapping[str, str],
    optimizers: Sequence[tuple[str, Mapping[str, tuple[str, str]]]],
) -> list[str]:
    """A foreign layout's :attr:`Layout.unclaimed`: the keys under the model's prefix that match no key of the
    model (wrapper segments ignored), other than the optimizers' entries. Under no prefix the directory may hold
    other components' entries too (a scheduler, a data loader), so only names below one of the model's own
    top-level names count."""
    claimed = {fqn for _, state in optimizers for fqn in state}
    tops = {k.partition(".")[0] for k in wanted}
    out = []
    for fqn in keys:
        if not fqn.startswith(prefix) or fqn in claimed or group_root(fqn) is not None:
            continue
        key = canonical(fqn[len(prefix) :])
        if key not in wanted and (prefix or key.partition(".")[0] in tops):
            out.append(fqn[len(prefix) :])
    return out
