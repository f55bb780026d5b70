"""The transport as the core sees it: one :class:`Transport` per ``shard()`` root's process groups and device.

[Note: the transport interface]
The core (``handle``, ``gradients``, ``runtime``) moves and holds flat tensors through a :class:`Transport`
and nothing else of this package: the all-gather of a unit, the reduce-scatter of its gradient and the
all-reduce across replicas, the flat buffers they use, and the blocks a pass reuses. What is specific to a
transport stays behind it:

- which implementation runs a collective: the shared-memory channel of CPU ranks on one host (see [Note:
  shared-memory collectives]) or the process group's backend, with its quirks (``comm``);
- whether a reduce-scatter takes a gradient still in autograd's per-parameter tensors
  (:class:`~flatshard.engine.transport.pieces.FlatPieces`) and reads it in place (:meth:`takes_pieces`);
- what memory suits a flat buffer: on CPU, large blocks in mappings of their own with huge pages (see [Note:
  huge pages for CPU buffers]); a shard that peers read in place gets them too (see [Note: reading peers
  directly]);
- the gathered blocks kept between the units of one pass (see [Note: reusing freed blocks]), which the
  runtime returns when a pass ends (:meth:`release_blocks`).

``shard()`` makes one per call and gives it to every handle it builds (a nested call reuses the inner one's,
so a model keeps one pool); a handle made alone makes its own. It holds no process-group state of its own:
that is the groups' (see [Note: state per process group]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flatshard.engine.transport import comm, memory
from flatshard.engine.transport.pieces import FlatPieces

__all__ = ["Transport"]

ProcessGroup = Any  # torch.distributed.ProcessGroup


class Transport:
    """Collectives and flat buffers for the units sharded over ``shard_group`` and replicated over
    ``replicate_group`` (either ``None`` for a side of one rank), computing on ``device``."""

    def __init__(
        self, shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None, device: torch.device
    ):
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.device = device
        distributed = shard_group is not None and dist.is_available() and dist.is_initialized()
        self.shard_world = dist.get_world_size(shard_group) if distributed else 1
        self.blocks = memory.FreedBlocks()  # gathered blocks freed in the current pass

    def __deepcopy__(self, memo: dict[int, Any]) -> Transport:
        """A copied model gets a transport of its own over the same groups (process groups are not copied)."""
        return Transport(self.shard_group, self.replicate_group, self.device)

    def serves(
        self, shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None, device: torch.device
    ) -> bool:
        """Whether it moves tensors of these groups and device (a nested ``shard()`` then shares it)."""
        return (
            self.shard_group is shard_group
            and self.replicate_group is replicate_group
            and self.device == device
        )

    def connect(self) -> None:
        """Collective over its groups: agree on how their collectives run now (the shared-memory channel of CPU
        ranks; see [Note: shared-memory collectives]). ``shard()`` calls it where every rank is in step, not
        inside the first flat collective: a rank that skipped it would leave its peers in the setup's own
        torch.distributed collective, where no flatshard wait can report the desync."""
        if self.device.type != "cpu" or not (dist.is_available() and dist.is_initialized()):
            return
        for group in [self.shard_group] + (
            [self.replicate_group] if self.replicate_group is not None else []
        ):
            comm.connect(group)

    # ------------------------------------------------------------------ collectives
    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, where: Any = None, group: Any = None
    ) -> comm.Pending:
        """Every rank's ``shard`` into ``output`` over the shard group (or ``group``, part of it), asynchronously."""
        return comm.all_gather_flat(output, shard, self.shard_group if group is None else group, where=where)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor | FlatPieces, where: Any = None
    ) -> comm.Pending:
        """The sum of ``full`` over the shard group, this rank's slice into ``output``, asynchronously."""
        return comm.reduce_scatter_flat(output, full, self.shard_group, where=where)

    def all_reduce(self, tensor: torch.Tensor, where: Any = None, async_op: bool = True) -> comm.Pending:
        """The sum of ``tensor`` over the replicate group, in place."""
        return comm.all_reduce_flat(tensor, self.replicate_group, async_op=async_op, where=where)

    def takes_pieces(self) -> bool:
        """Whether :meth:`reduce_scatter` reads a :class:`FlatPieces` gradient in place (the shared-memory
        channel), so it need not be packed into one buffer first."""
        return self.shard_world > 1 and self.device.type == "cpu" and comm.reads_pieces(self.shard_group)

    # ------------------------------------------------------------------ memory
    def empty_flat(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of a step (a gradient to reduce, a reduced shard, a cast copy), uninitialized."""
        return memory.empty_flat(numel, dtype, self.device)

    def empty_shard(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Storage for a shard that lives as long as the model, uninitialized; sharded over CPU ranks, a mapping of
        its own (so it pins no heap memory that transient buffers would reuse) with huge pages, which peers read
        fastest."""
        if self.device.type != "cpu" or self.shard_world == 1:
            return torch.empty(numel, dtype=dtype, device=self.device)
        shard = memory.empty_mapped((numel,), dtype)
        memory.advise_hugepages(shard)
        return shard

    def empty_transient(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A large flat tensor that lives briefly (a unit's whole flat parameter while it is cut into shards):
        sharded over CPU ranks, a mapping of its own, returned to the system when freed (see [Note: materializing
        unit by unit]); ``None`` elsewhere: any allocation does."""
        if self.device.type != "cpu" or self.shard_world == 1:
            return None
        return memory.empty_mapped((numel,), dtype)

    def alloc_gathered(self, t: torch.Tensor) -> None:
        """Give a gathered buffer, freed by :meth:`free_gathered`, its storage again (a kept block if any)."""
        memory.alloc_storage(t, self.blocks)

    def free_gathered(self, t: torch.Tensor) -> None:
        """Free a gathered buffer's storage, keeping its block for the next gather of the pass."""
        memory.free_storage(t, self.blocks)

    def release_blocks(self) -> None:
        """The pass is over: return the kept blocks (see [Note: reusing freed blocks])."""
        self.blocks.clear()
