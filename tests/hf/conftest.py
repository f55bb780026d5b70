"""The Hugging Face tier runs offline: tiny models built from configs, nothing is downloaded.

The variables are set when pytest imports this file, before any rank is started, so every spawned rank
inherits them (the harness passes the caller's environment along). ``transformers`` is imported only by the
test modules and ``hf_common``, after that.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case of ``hf_common.TRAIN_CASES`` fitted once on 2 ranks, in one spawn shared by the parity and
    checkpoint tests: ``{"dir": the directory of the checkpoints, "losses": [per-rank {case: losses}]}``."""
    from flatshard.testing import spawn

    from .hf_common import TRAIN_CASES, train_cases

    out = tmp_path_factory.mktemp("hf_trained")
    return {"dir": out, "losses": spawn(train_cases, 2, str(out), TRAIN_CASES)}
