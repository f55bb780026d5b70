"""Test configuration: GPU-marked tests run only where CUDA is available; spawned ranks fork from a server
that imported torch once (see [Note: start method] in ``flatshard.testing.harness``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("FLATSHARD_TEST_START_METHOD", "forkserver")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `python -m pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
