"""``flatshard estimate --cpu-offload optimizer``: the optimizer state leaves the device, the host holds it and the
host copies of each rank's trainable shard and gradient shard (see [Note: optimizer offload])."""

from __future__ import annotations

import json

import pytest

from flatshard.cli import main
from flatshard.estimator import estimate
from flatshard.testing.models import Block
from tests.estimate.models import gpt

WRAP = {Block}


def test_optimizer_offload_moves_only_the_optimizer_state() -> None:
    on_device = estimate(gpt, 2, auto_wrap_policy=WRAP).rows[0]
    row = estimate(gpt, 2, auto_wrap_policy=WRAP, cpu_offload="optimizer").rows[0]
    assert row.offload == "optimizer"
    assert row.optimizer == on_device.optimizer > 0
    assert row.params == on_device.params and row.grads == on_device.grads
    assert row.peak == on_device.peak - on_device.optimizer
    # fp32 shards and gradients: host copies of both, the size of the gradient shards each
    assert row.host == on_device.optimizer + 2 * on_device.grads
    assert row.persistent == on_device.params + on_device.grads
    assert any("cpu_offload='optimizer'" in n for n in row.notes)


def test_command_line_takes_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    target = "tests.estimate.models:gpt"
    assert main(["estimate", target, "-n", "2", "--wrap", "tests.estimate.models.Block", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["rows"][0]
    argv = ["estimate", target, "-n", "2", "--wrap", "tests.estimate.models.Block", "--json", "--cpu-offload"]
    assert main([*argv, "optimizer"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["offload"] == "optimizer" and row["host"] > plain["optimizer"]
    assert row["peak"] == plain["peak"] - plain["optimizer"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["offload"] is True
    with pytest.raises(SystemExit):
        main([*argv, "gpu"])
