"""Tensors that nothing has given a value yet: found at ``shard()``, refused at the first use.

[Note: unfilled tensors]
A model built on the meta device has no values. ``shard()`` gives each module's tensors storage and asks,
per module, for values: ``param_init_fn(module)``, else (inside a Hugging Face ``PreTrainedModel``) the
model's own ``_init_weights(module)`` for the buffers only, else the module's ``reset_parameters()``.
A parameter or buffer that none of them wrote is **unfilled**; it is not made zeros (zeros are plausible
values: rotary ``inv_freq`` buffers left at zero give wrong logits without a word):

- an unfilled parameter of a unit keeps no full storage at all: its pieces of the local shard hold
  :data:`MARKER` bytes (all bits set: NaN in floating dtypes), and its handle lists it in ``unfilled``;
- an unfilled buffer holds the marker bytes and is listed, with its version counter, by the root unit.

Whatever writes them fills them: ``flatshard.load_pretrained``, a full or sharded checkpoint load, the
module's own ``load_state_dict`` (a hook notes each key it is given), ``unshard_params`` with writeback
for buffers and parameters changed there. A buffer counts as filled once it is replaced, written (its
version counter moved) or holds other bytes. The first forward, and any save, before every listed tensor
is filled raises :class:`UnfilledError` naming them, on every rank alike (the lists are the same on
every rank: ``sync_module_states`` takes rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = [
    "MARKER",
    "BufferMark",
    "UnfilledError",
    "fill_marker",
    "holds_marker",
    "mark_buffer",
    "unfilled_message",
]

MARKER = 0xFF  # the byte an unfilled tensor holds: NaN in floating dtypes, -1 in signed integers
_CHUNK = 16 * 2**20  # bytes compared at a time


class UnfilledError(RuntimeError):
    """A parameter or buffer of a meta-built model was used or saved before anything gave it a value."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def fill_marker(t: torch.Tensor) -> None:
    """Write :data:`MARKER` into every byte of ``t`` (contiguous), bypassing autograd."""
    if t.numel():
        with torch.no_grad():
            _bytes(t).fill_(MARKER)


def holds_marker(t: torch.Tensor) -> bool:
    """Whether every byte of ``t`` is still :data:`MARKER` (an empty tensor: never written, so yes)."""
    data = _bytes(t.contiguous())
    for start in range(0, data.numel(), _CHUNK):
        if not bool((data[start : start + _CHUNK] == MARKER).all()):
            return False
    return True


@dataclass
class BufferMark:
    """An unfilled buffer: where it lives, the tensor it was and its version counter then."""

    module: nn.Module
    attr: str
    name: str  # its name under the sharded root, for messages
    tensor: torch.Tensor
    version: int

    def filled(self) -> bool:
        now = self.module._buffers.get(self.attr)
        if now is not self.tensor or now._version != self.version:
            return True
        return not holds_marker(now) if now.device.type != "meta" else False


def mark_buffer(module: nn.Module, attr: str, name: str) -> BufferMark:
    tensor = module._buffers[attr]
    assert tensor is not None
    fill_marker(tensor)
    return BufferMark(module, attr, name, tensor, tensor._version)


def unfilled_message(names: list[str], what: str) -> str:
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{what}, but {len(names)} tensor(s) of the meta-built model were never given values: {shown}. Nothing "
        "initialized them (no param_init_fn value, no reset_parameters(), not in a loaded checkpoint). HINT: load "
        "the weights first (flatshard.load_pretrained(model, 'path/or/url'), or a checkpoint), or pass "
        "param_init_fn=fn to shard() / the strategy to initialize them; see 'Starting from a pretrained model' "
        "in the guide."
    )
