"""Make shared-memory segments fail in one rank, the way a full ``/dev/shm`` or a refused mapping does."""

from __future__ import annotations

from flatshard.engine.transport import shm


def fail_segments(creating: bool) -> None:
    """From now on, in this process, creating (``creating=True``) or mapping a peer's segment raises."""
    real_init = shm.Segment.__init__
    message = "sabotaged: no space in /dev/shm" if creating else "sabotaged: cannot map a peer's segment"

    def init(self: shm.Segment, path: str, nbytes: int, create: bool) -> None:
        if create == creating:
            raise OSError(message)
        real_init(self, path, nbytes, create)

    shm.Segment.__init__ = init  # type: ignore[method-assign]
