"""What ``flatshard estimate`` suggests when nothing fits: each memory lever not in use, by its flag, with what it
moves or shrinks; never a lever the estimate already used (activation checkpointing and its mode, activation
offload, ``--cpu-offload`` and ``--cpu-offload optimizer``)."""

from __future__ import annotations

from typing import Any

import pytest

from flatshard.cli import main
from flatshard.estimator import estimate
from flatshard.testing.models import Block
from tests.estimate.models import gpt

WRAP = {Block}
# the small GPT's step needs a few MiB
TIGHT: dict[str, Any] = {"device": "cuda", "capacity": "1MiB", "overhead": 0}


def _diagnosis(**options: Any) -> str:
    est = estimate(gpt, 2, auto_wrap_policy=WRAP, **TIGHT, **options)
    message = est.diagnosis()
    assert message is not None and "does not fit" in message and "HINT:" in message, message
    return message


def test_every_lever_not_in_use_is_named() -> None:
    message = _diagnosis()
    assert "activation checkpointing shrinks the" in message and "--checkpoint BlockClass" in message
    assert "--activation-checkpointing-mode full" in message
    assert "--activation-checkpointing-mode selective" in message
    assert "--activation-offload moves the units' saved activations to host memory" in message
    assert "--cpu-offload moves" in message and "--cpu-offload optimizer: only the" in message
    assert "a smaller per-rank batch" in message


def test_levers_in_use_are_not_suggested_again() -> None:
    selective = _diagnosis(
        activation_checkpointing_policy=WRAP,
        activation_checkpointing_mode="selective",
        activation_offload=True,
        cpu_offload="optimizer",
    )
    assert "--activation-checkpointing-mode full (now selective)" in selective
    assert "--activation-checkpointing-mode selective" not in selective and "--checkpoint" not in selective
    assert "--activation-offload" not in selective and "--cpu-offload optimizer" not in selective
    # the shards are still on the device
    assert "--cpu-offload (not only the optimizer) moves the" in selective

    listed = _diagnosis(activation_checkpointing_policy=WRAP, activation_checkpointing_mode=["aten.mm"])
    assert "--activation-checkpointing-mode full (now a list of operators)" in listed

    full = _diagnosis(activation_checkpointing_policy=WRAP, cpu_offload=True)
    assert "--activation-checkpointing-mode" not in full and "activation checkpointing" not in full
    assert "--cpu-offload" not in full
    assert "--activation-offload" in full and "a smaller per-rank batch" in full


def test_activation_offload_is_not_suggested_on_a_cpu_device() -> None:
    est = estimate(gpt, 2, auto_wrap_policy=WRAP, device="cpu", capacity="1MiB", overhead=0)
    message = est.diagnosis()
    assert message is not None and "activation checkpointing" in message, message
    assert "--activation-offload" not in message


def test_command_prints_the_hint(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "tests.estimate.models:gpt", "-n", "2", "--wrap", "tests.estimate.models.Block"]
    argv += ["--checkpoint", "tests.estimate.models.Block", "--activation-checkpointing-mode", "selective"]
    assert main([*argv, "--gpu-memory", "1MiB", "--overhead", "0"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "--activation-checkpointing-mode full (now selective)" in err, err
    assert "--activation-offload" in err and "--cpu-offload optimizer" in err, err
