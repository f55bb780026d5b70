"""The error every checkpoint reader, writer and storage check raises."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint could not be read or written, or does not fit; the message names it and the fix."""
