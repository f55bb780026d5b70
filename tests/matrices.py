"""Parity matrices that several test modules run, each with its quick case first and the rest marked ``slow``
(see the tiers in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

# (world size, sharding strategy): FULL_SHARD on 2 ranks in the quick tier; SHARD_GRAD_OP on 3 ranks (uneven
# shards, padding) and NO_SHARD in the full run.
WORLD_AND_STRATEGY = [
    (2, "FULL_SHARD"),
    pytest.param(3, "SHARD_GRAD_OP", marks=pytest.mark.slow),
    pytest.param(2, "NO_SHARD", marks=pytest.mark.slow),
]
