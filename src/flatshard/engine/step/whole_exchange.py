"""The collectives of whole-tensor optimizers, as plain functions over a :class:`WholeGroup`.

See [Note: whole-tensor optimizers] in ``flatshard.engine.step.whole_tensor``: :func:`to_owners` and
:func:`from_owners` are the two all-to-alls (pieces to each parameter's owner, whole tensors back as pieces), and
:func:`agree_on_step` / :func:`agree_on` are the cheap checks before them that every rank of the shard group
exchanges the same parameters, the same way (see [Note: the ranks agree before an all-to-all]).

[Note: the ranks agree before an all-to-all]
An all-to-all's split sizes are computed on each rank from what that rank believes is exchanged: its plan (which
parameters, their pieces' sizes on every rank, their owners) and, in a step, which of them have a gradient. A rank
that believes otherwise (an optimizer built over other parameters on one rank, a gradient set to ``None`` on one
rank only) would pass other splits: the collective hangs or delivers garbage. So before each step's exchange the
ranks all-reduce (MAX) one small fixed-size header per shard group: a 62-bit digest ``d`` of the plan and ``-d``,
a digest ``l`` of the live parameters' positions and ``-l``, and whether any rank needs values sent (see [Note:
whole-tensor optimizers], 4.). The MAX of ``d`` equals minus the MAX of ``-d`` exactly when every rank has the same
``d``, so one collective both checks and carries the flag; its size never depends on what is checked, so even
ranks that disagree complete it. Only when some rank needs values does a second all-reduce carry one flag per
live parameter. When the ranks disagree every rank sees it in the same reduced header, so all of them take the
error path together: one ``all_gather_object`` of each rank's parameters names the ranks and the parameters that
differ, and nothing is exchanged. Loads (``after_load``) check their list of state tensors the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatshard.engine.step.whole_plan import WholeGroup, WholeParam, digest
from flatshard.engine.transport import watchdog

__all__ = [
    "Entry",
    "agree_on",
    "agree_on_step",
    "from_owners",
    "mismatch_message",
    "to_owners",
]

Entry = tuple[WholeParam, torch.Tensor | None]


def _all_reduce_max(g: WholeGroup, values: list[int], what: str) -> list[int]:
    box = torch.tensor(values, dtype=torch.int64, device=g.device)
    work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=g.group, async_op=True)
    watchdog.wait_collective(work, f"all_reduce of {what}", g.group, "all_reduce")
    return [int(v) for v in box.tolist()]


def agree_on_step(g: WholeGroup, live: list[int], stale: list[bool], what: str) -> list[bool]:
    """Before a step's exchange (see [Note: the ranks agree before an all-to-all]): raise unless every rank of the
    group has the same plan and the same ``live`` (positions in ``g.params`` of the parameters with a gradient);
    return, for each live parameter, whether any rank flagged it ``stale``. ``what`` names the optimizer."""
    d, lv = g.digest, digest(live)
    header = _all_reduce_max(
        g, [d, -d, lv, -lv, int(any(stale))], f"the check before {what}'s exchange (whole-tensor optimizer)"
    )
    if header[0] != -header[1] or header[2] != -header[3]:
        mine = {"params": g.describe(), "live": [g.params[i].name for i in live]}
        _raise_mismatch(g, mine, what)
    if not header[4]:
        return [False] * len(live)
    flags = _all_reduce_max(
        g, [int(f) for f in stale], f"{what}'s flags of stale values (whole-tensor optimizer)"
    )
    return [bool(f) for f in flags]


def agree_on(g: WholeGroup, items: Sequence[object], what: str, problem: str | None = None) -> None:
    """Raise unless every rank of the group passes the same ``items`` (what an exchange is about to move) and no
    rank has a ``problem`` (a rank's reason not to go on, raised on every rank as ``ValueError``); one all-reduce,
    see [Note: the ranks agree before an all-to-all]."""
    d = digest((g.digest, list(items)))
    header = _all_reduce_max(
        g, [d, -d, int(problem is not None)], f"the check before {what} (whole-tensor optimizer)"
    )
    if header[2]:
        problems: list[Any] = [None] * g.world
        dist.all_gather_object(problems, problem, group=g.group)
        ranks = _global_ranks(g)
        first = next(r for r, text in enumerate(problems) if text is not None)
        raise ValueError(
            problem if problem is not None else f"On global rank {ranks[first]}: {problems[first]}"
        )
    if header[0] != -header[1]:
        _raise_mismatch(g, {"params": g.describe(), "items": [repr(i) for i in items]}, what)


def _global_ranks(g: WholeGroup) -> list[int]:
    return dist.get_process_group_ranks(g.group) if g.group is not None else list(range(g.world))


def _raise_mismatch(g: WholeGroup, mine: dict[str, Any], what: str) -> None:
    everyone: list[Any] = [None] * g.world
    dist.all_gather_object(everyone, mine, group=g.group)
    raise RuntimeError(mismatch_message(everyone, _global_ranks(g), g.rank, what))


def mismatch_message(everyone: list[dict[str, Any]], ranks: list[int], rank: int, what: str) -> str:
    """The error when the ranks of a shard group (``everyone``: each group rank's record; ``ranks``: their global
    ranks) disagree before an exchange of ``what``: which ranks differ from which, and in which parameters."""
    lead = (
        f"flatshard (rank {ranks[rank]}): the ranks of a shard group (global ranks {ranks}) disagree on what "
        f"{what} exchanges between them, so its all-to-all would hang or deliver garbage; nothing was exchanged"
    )
    base = everyone[0]
    other = [r for r, e in enumerate(everyone) if e["params"] != base["params"]]
    if other:
        first = other[0]
        a, b = base["params"], everyone[first]["params"]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return (
            f"{lead}. Its sharded parameters (name, shape, owner, elements on each rank) differ: global rank "
            f"{ranks[0]} has {len(a)}, global ranks {[ranks[r] for r in other]} others (global rank {ranks[first]}: "
            f"{len(b)}); the first difference is at #{at}: {_at(a, at)} on rank {ranks[0]}, {_at(b, at)} on rank "
            f"{ranks[first]}. HINT: build the optimizer over the same parameters, in the same order, on every rank."
        )
    if "live" in base:
        names = [entry[0] for entry in base["params"]]
        lines = []
        for name in names:
            have = [ranks[r] for r, e in enumerate(everyone) if name in e["live"]]
            if have and len(have) < len(everyone):
                lacking = [ranks[r] for r, e in enumerate(everyone) if name not in e["live"]]
                lines.append(f"{name!r} has a gradient on ranks {have}, none on ranks {lacking}")
        return (
            f"{lead}. The parameters with a gradient differ: {'; '.join(lines[:8])}"
            f"{' ...' if len(lines) > 8 else ''}. HINT: every rank must step the same parameters: do not set a "
            "gradient to None on some ranks only (p.grad = None, or zero_grad on some ranks only, or a parameter "
            "frozen on some ranks only); give it a gradient on every rank (zeros) or on none."
        )
    other = [r for r, e in enumerate(everyone) if e.get("items") != base.get("items")] or [0]
    return (
        f"{lead}. Global ranks {[ranks[r] for r in other]} move other tensors than global rank {ranks[0]} "
        f"(first of theirs: {everyone[other[0]].get('items', [])[:4]}, of rank {ranks[0]}: "
        f"{base.get('items', [])[:4]}). HINT: load the same checkpoint on every rank, through "
        "flatshard.load_checkpoint or flatshard.set_state_dict."
    )


def _at(params: list[Any], i: int) -> str:
    return repr(tuple(params[i])) if i < len(params) else "nothing"


def _all_to_all(
    g: WholeGroup,
    send: list[torch.Tensor],
    in_splits: list[int],
    out_splits: list[int],
    dtype: torch.dtype,
    what: str,
) -> torch.Tensor:
    flat_in = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=g.device)
    flat_out = torch.empty(sum(out_splits), dtype=dtype, device=g.device)
    work = dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=g.group, async_op=True)
    watchdog.wait_collective(
        work, f"all_to_all of {what} ({flat_in.numel()} elements)", g.group, "all_to_all"
    )
    return flat_out


def to_owners(g: WholeGroup, entries: list[Entry], dtype: torch.dtype, what: str) -> dict[int, torch.Tensor]:
    """Each rank gives its flat piece of every entry (the same entries, in the same order, on every rank); returns,
    by position in ``entries``, the whole flat tensors of those this rank owns."""
    send = [
        t.to(g.device, dtype) for d in range(g.world) for q, t in entries if q.owner == d and t is not None
    ]
    in_splits = [sum(q.counts[g.rank] for q, _ in entries if q.owner == d) for d in range(g.world)]
    out_splits = [sum(q.counts[s] for q, _ in entries if q.owned) for s in range(g.world)]
    flat_out = _all_to_all(g, send, in_splits, out_splits, dtype, what)
    wholes = {
        i: torch.empty(q.shape.numel(), dtype=dtype, device=g.device)
        for i, (q, _) in enumerate(entries)
        if q.owned
    }
    pos = 0
    for s in range(g.world):  # from each source, its pieces of the entries owned here, in order
        for i in wholes:
            q = entries[i][0]
            n, at = q.counts[s], q.starts[s]
            wholes[i][at : at + n].copy_(flat_out[pos : pos + n])
            pos += n
    return wholes


def from_owners(
    g: WholeGroup, entries: list[Entry], dtype: torch.dtype, what: str
) -> dict[int, torch.Tensor]:
    """The owner of every entry gives its whole flat tensor (``None`` elsewhere); returns, by position in
    ``entries``, this rank's piece of each."""
    send = [
        t[q.starts[d] : q.starts[d] + q.counts[d]].to(g.device, dtype)
        for d in range(g.world)
        for q, t in entries
        if q.owned and t is not None
    ]
    in_splits = [sum(q.counts[d] for q, _ in entries if q.owned) for d in range(g.world)]
    out_splits = [sum(q.counts[g.rank] for q, _ in entries if q.owner == s) for s in range(g.world)]
    flat_out = _all_to_all(g, send, in_splits, out_splits, dtype, what)
    pieces: dict[int, torch.Tensor] = {}
    pos = 0
    for s in range(g.world):
        for i, (q, _) in enumerate(entries):
            if q.owner == s:
                n = q.counts[g.rank]
                pieces[i] = flat_out[pos : pos + n]
                pos += n
    return pieces
