"""Where ``shard()`` puts a model when ``device`` is not given, with the backends torch may report (faked: no
GPU or process group is needed). A CUDA model staying on its device is checked by ``tests/gpu``."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from flatshard.engine.transport import comm

shard_module = importlib.import_module("flatshard.engine.shard")  # the module, not the shard() function

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _fake(monkeypatch: pytest.MonkeyPatch, backend: str | None, cuda: bool = True) -> None:
    monkeypatch.setattr(shard_module.dist, "is_initialized", lambda: backend is not None)
    monkeypatch.setattr(shard_module.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize(
    ("backend", "meta", "expected"),
    [
        (None, False, CPU),  # no process group, a CPU model stays on the CPU
        ("gloo", False, CPU),
        ("nccl", False, CUDA0),  # NCCL needs CUDA tensors: the model goes to the current device
        ("cpu:gloo,cuda:nccl", False, CUDA0),  # a backend per device type names NCCL too
        ("undefined", False, CPU),  # left to torch: a CPU model stays where it is
        ("undefined", True, CUDA0),  # ... a meta-device model, with CUDA present, goes to the GPU
        ("gloo", True, CPU),
    ],
)
def test_default_device(
    monkeypatch: pytest.MonkeyPatch, backend: str | None, meta: bool, expected: torch.device
) -> None:
    _fake(monkeypatch, backend)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    assert shard_module._default_device(model, set(), None) == expected
    assert comm.uses_nccl(None) == (backend is not None and "nccl" in backend)  # join's device choice too


def test_undefined_backend_without_cuda_stays_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, "undefined", cuda=False)
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    assert shard_module._default_device(model, set(), None) == CPU
