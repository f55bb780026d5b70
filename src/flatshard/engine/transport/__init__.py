"""How bytes move between ranks: imports nothing from the rest of the engine.

- ``comm``: the flat collectives (all-gather, reduce-scatter, all-reduce) as plain functions returning
  :class:`~flatshard.engine.transport.comm.Pending`; the collective timeline and byte counters.
- ``shm``: the shared-memory transport that replaces gloo for CPU ranks of one host.
- ``pieces``: :class:`FlatPieces`, a flat tensor given as pieces, read by a collective without packing.
- ``memory``: large CPU blocks (huge pages, mapped blocks freed at once, prefaulting).
- ``streams``: the named CUDA streams and events of one root (collapsed to the current stream on CPU).
- ``limiter``: the all-gather rate limiter.
- ``env``: the ``FLATSHARD_*`` environment switches, validated where they are read.
- ``watchdog``: the desync detector; ``processes``: which process this is and whether another still runs.
"""

from flatshard.engine.transport.comm import CollectiveTiming, Pending, comm_stats, timeline
from flatshard.engine.transport.limiter import AllGatherLimiter
from flatshard.engine.transport.pieces import FlatPieces
from flatshard.engine.transport.streams import CommContext

__all__ = [
    "AllGatherLimiter",
    "CollectiveTiming",
    "CommContext",
    "FlatPieces",
    "Pending",
    "comm_stats",
    "timeline",
]
