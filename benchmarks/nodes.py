"""Ranks as nodes (``train --ranks-per-node R``): the bytes each process group carries, split into what stays in a
node and what crosses nodes, and a link model for the cross-node part.

A rank's node is ``rank // R``. A process group is *intra-node* when all its ranks lie in one node (the shard group
of hybrid sharding with ``shard_group_size=R``, the node-local group of ``reshard_after_forward=R``) and
*cross-node* otherwise (FULL_SHARD's world group, hybrid sharding's replicate group). The bytes are what the engine
counts per group (``groups.state_of(pg).sent``: a collective's input on this rank), read between the phases of a
step (forward, backward, the optimizer step).

[Note: the cross-node link model]
This is a model, not a measurement: the CPU ranks share one machine's memory, so nothing is slow between "nodes".
Each collective is taken to run as a ring over its group's ranks in rank order, as NCCL's ring algorithm does:
every link of the ring carries ``(W-1)/W`` of the full buffer for an all-gather or a reduce-scatter and twice that
for an all-reduce (``W`` the group's size; an all-gather's input is one shard, so ``W-1`` inputs). The links that
leave a node go through its network card; a rank is charged the links that leave its node in that ring, shared
among the node's ranks in the group. Summed over a node's ranks that is what the node's card sends, so at a
bandwidth per rank of the card's divided by its ranks (``--cross-node-gbps``: 25 Gbit/s is a 200 Gbit/s card
shared by 8 GPUs), a rank's share over that bandwidth is the card's time. The modelled step is the measured step
plus that time: no overlap with compute and no latency, so an upper bound of what the link adds at that bandwidth.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
PHASES = ("forward", "backward", "step")
SCOPES = ("intra_node", "cross_node")


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def scope(ranks: tuple[int, ...] | list[int], ranks_per_node: int) -> str:
    """``intra_node`` if every rank of the group lies in one node, else ``cross_node``."""
    return "intra_node" if len({node_of(r, ranks_per_node) for r in ranks}) <= 1 else "cross_node"


def link_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """What one link of a ring over ``group_size`` ranks carries for a collective whose input on a rank is
    ``nbytes`` (see [Note: the cross-node link model])."""
    w = group_size
    if w <= 1:
        return 0.0
    if kind == "all_gather":  # the input is one shard: the ring passes on W - 1 of them
        return (w - 1) * nbytes
    if kind == "reduce_scatter":
        return (w - 1) / w * nbytes
    if kind == "all_reduce":  # a reduce-scatter, then an all-gather
        return 2 * (w - 1) / w * nbytes
    raise ValueError(f"unknown collective kind {kind!r}. HINT: one of {', '.join(KINDS)}")


def node_link_share(ranks: tuple[int, ...] | list[int], rank: int, ranks_per_node: int) -> float:
    """How many of a ring's links ``rank`` is charged: the links of the ring over ``ranks`` (in rank order) that
    leave ``rank``'s node, over the node's ranks in the group. 0 for an intra-node group."""
    ring = sorted(ranks)
    mine = node_of(rank, ranks_per_node)
    nodes = [node_of(r, ranks_per_node) for r in ring]
    leaving = sum(1 for i, n in enumerate(nodes) if n == mine and nodes[(i + 1) % len(nodes)] != mine)
    return leaving / nodes.count(mine)


def link_s(cross_node_link_bytes: float, gbps: float) -> float:
    """Seconds ``cross_node_link_bytes`` take at ``gbps`` Gbit/s."""
    return cross_node_link_bytes * 8 / (gbps * 1e9)


class GroupBytes:
    """Bytes this rank sent into flatshard's collectives since the last :meth:`mark`, per node scope, phase and
    kind, and the cross-node link bytes of [Note: the cross-node link model]. Reads every process group the engine
    keeps a state for (``groups.live()``), so a group made during training counts too."""

    def __init__(self, rank: int, ranks_per_node: int) -> None:
        self.rank, self.ranks_per_node = rank, ranks_per_node
        self.totals: dict[str, float] = {}
        self._last = self._read()

    @staticmethod
    def _read() -> dict[Any, Counter[str]]:
        from flatshard.engine.transport import groups

        return {state: Counter(state.sent) for _, state in groups.live()}

    def mark(self, phase: str) -> None:
        """Add what was sent since the last mark to ``phase``."""
        now = self._read()
        for state, sent in now.items():
            delta = sent - self._last.get(state, Counter())
            if not delta:
                continue
            where = scope(state.ranks, self.ranks_per_node)
            share = (
                node_link_share(state.ranks, self.rank, self.ranks_per_node) if where == "cross_node" else 0
            )
            for kind, n in delta.items():
                key = f"{where}.{phase}.{kind}"
                self.totals[key] = self.totals.get(key, 0) + n
                if share:
                    link = share * link_bytes(kind, n, len(state.ranks))
                    self.totals["cross_node_link"] = self.totals.get("cross_node_link", 0.0) + link
        self._last = now

    def take(self) -> dict[str, float]:
        """The totals since the last take (keys ``SCOPE.PHASE.KIND`` and ``cross_node_link``), and start again."""
        out, self.totals = self.totals, {}
        return out


def summed(counts: dict[str, float], scope_: str, phase: str | None = None, kind: str | None = None) -> float:
    """The bytes of ``counts`` (a :meth:`GroupBytes.take`) in ``scope_``, of one phase and kind or all."""
    total = 0.0
    for key, n in counts.items():
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != scope_:
            continue
        if (phase is None or parts[1] == phase) and (kind is None or parts[2] == kind):
            total += n
    return total
