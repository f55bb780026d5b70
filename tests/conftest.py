"""Test configuration: GPU-marked tests run only where CUDA is available; spawned ranks fork from a server
that imported torch once (see [Note: start method] in ``flatshard.testing.harness``).

Tiers (one folder each):

- ``unit``: one process, no ranks: option checks, index math, file formats, the CLI, the shared-memory transport.
- ``distributed``: the engine (``shard()``) on 1 to 4 gloo ranks, each case against an unsharded reference.
- ``estimate``: ``flatshard estimate`` (the real ``shard()`` on the meta device), and against measured runs.
- ``lightning`` / ``fabric``: the Trainer and Fabric shells against DDP and a single device.
- ``faults``: killed ranks, full disks, failing uploads, damaged checkpoints, slow and out-of-step ranks.
- ``hf``: Hugging Face models trained, loaded (``load_pretrained``) and saved (``save_pretrained``), offline.
- ``storage``: checkpoints on fsspec URLs, ``s3://`` through a local S3 server (moto).
- ``examples``: the example scripts run as a user runs them.
- ``gpu``: CUDA only (``python -m pytest -m gpu``); skipped where there is no CUDA device.

``python -m pytest`` (the README's command, what CI runs) runs every tier. ``python -m pytest -m "not slow"`` is
the quick tier for iterating (a few minutes on 2 cores). It still touches every subsystem: the engine, each
checkpoint format, both shells, the estimator, faults and desyncs, Hugging Face weights and storage.

What is marked ``slow`` (``pytest.mark.slow`` on a test, ``pytest.param(..., marks=pytest.mark.slow)`` on a
case, ``pytestmark`` on a module):

- the examples tier, and tests that start subprocesses to run scripts, launchers or the CLI end to end;
- fault tests that sleep or wait for a timeout (desync limits, killed ranks, slow ranks);
- the Hugging Face and storage tiers beyond one smoke test each (in-process tests under a second stay quick);
- parity matrices beyond one smoke case per shell: where the same matrix (strategies x wrap policies x world
  sizes, precisions, ...) runs through ``shard()``, the Trainer and Fabric, one representative case of each
  shell stays quick and the rest of the matrix is slow;
- anything over ~10 s (on 2 cores) whose code path a quicker test also covers.

A new test is quick unless one of these applies.
"""

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
