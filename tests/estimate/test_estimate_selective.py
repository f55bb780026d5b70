"""``flatshard estimate`` with ``activation_checkpointing_mode``: the dry run runs the policy itself, so the
activations it counts fall between full checkpointing and none; the command line takes the mode and refuses it
without ``--checkpoint`` or with an unknown operator (the real-run check: ``test_measured.py``)."""

from __future__ import annotations

import json

import pytest

from flatshard.cli import main
from flatshard.estimator import estimate
from flatshard.testing.llama import LlamaBlock, tiny_llama


def _activations(**options: object) -> int:
    row = estimate(
        tiny_llama,
        2,
        device="cpu",
        overhead=0,
        auto_wrap_policy={LlamaBlock},
        **options,  # type: ignore[arg-type]
    ).rows[0]
    assert row.activations is not None
    return row.activations


def test_selective_activations_fall_between_full_and_none() -> None:
    none = _activations()
    full = _activations(activation_checkpointing_policy={LlamaBlock})
    selective = _activations(
        activation_checkpointing_policy={LlamaBlock}, activation_checkpointing_mode="selective"
    )
    listed = _activations(
        activation_checkpointing_policy={LlamaBlock}, activation_checkpointing_mode=["aten.mm"]
    )
    assert none > selective > full, (none, selective, full)
    assert selective >= listed > full, (selective, listed, full)  # Llama's matrix products are all mm


def test_command_takes_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "flatshard.testing.llama:tiny_llama", "-n", "2", "--device", "cpu", "--overhead", "0"]
    argv += ["--wrap", "LlamaBlock", "--checkpoint", "LlamaBlock", "--json"]
    assert main([*argv, "--activation-checkpointing-mode", "selective"]) == 0
    selective = json.loads(capsys.readouterr().out)
    assert selective["options"]["activation_checkpointing_mode"] == "selective"
    assert main([*argv, "--activation-checkpointing-mode", "aten.mm, aten.addmm"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["options"]["activation_checkpointing_mode"] == ["aten.mm", "aten.addmm"]
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["options"]["activation_checkpointing_mode"] == "full"
    assert full["rows"][0]["activations"] < selective["rows"][0]["activations"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--activation-checkpointing-mode", "selective"], "--checkpoint names none"),
        (["--checkpoint", "LlamaBlock", "--activation-checkpointing-mode", "aten.mmm"], "'aten.mmm'"),
        (["--checkpoint", "LlamaBlock", "--activation-checkpointing-mode", "most"], "'most' is not a mode"),
    ],
)
def test_command_refuses_a_bad_mode(
    extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["estimate", "flatshard.testing.llama:tiny_llama", "-n", "2", "--device", "cpu", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "HINT" in err, err
