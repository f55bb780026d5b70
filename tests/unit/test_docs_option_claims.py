"""What the docs say each option does, held against the code: every argument of Lightning's ``FSDPStrategy``
and of torch's ``FullyShardedDataParallel`` has a row in ``docs/migrating.md``; a row that says the argument
is taken is taken by both strategies, one that says it is refused raises ``TypeError``; ``docs/limits.md`` and
``docs/troubleshooting.md`` name the same refusals with the messages the code prints."""

from __future__ import annotations

import ast
import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

import flatshard

DOCS = Path(__file__).parents[2] / "docs"
STRATEGIES = [flatshard.FlatShardStrategy, flatshard.FlatShardFabricStrategy]

# A value for each argument, as a user moving an FSDPStrategy configuration over would pass it.
SAMPLES: dict[str, Any] = {
    "accelerator": None,
    "parallel_devices": [torch.device("cpu")] * 2,
    "cluster_environment": None,
    "checkpoint_io": None,
    "precision_plugin": None,
    "process_group_backend": "gloo",
    "timeout": timedelta(minutes=5),
    "cpu_offload": True,
    "mixed_precision": {"param_dtype": "bf16"},
    "auto_wrap_policy": {nn.Linear},
    "activation_checkpointing": nn.Linear,
    "activation_checkpointing_policy": {nn.Linear},
    "sharding_strategy": "SHARD_GRAD_OP",
    "state_dict_type": "sharded",
    "device_mesh": (1, 2),
    "backward_prefetch": "BACKWARD_POST",
    "forward_prefetch": True,
    "limit_all_gathers": False,
    "sync_module_states": True,
    "param_init_fn": lambda module: None,
    "ignored_modules": [nn.Linear(1, 1)],
    "ignored_states": [nn.Parameter(torch.zeros(1))],
    "device_id": 0,
    "use_orig_params": True,  # what FSDPStrategy sets; the row names False apart
    "process_group": None,
}
HYBRID_ONLY = {"device_mesh", "process_group"}  # taken with a hybrid sharding strategy only (the rows say so)
SHELL_ONLY = {  # arguments of one shell: the Trainer's strategy takes Lightning's plugins, Fabric's its own
    flatshard.FlatShardFabricStrategy: {"activation_checkpointing"},
}


def _table(markdown: str, header: str) -> dict[str, str]:
    """The rows of the markdown table whose header row starts with ``header``: first cell's name -> second cell."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        name = re.fullmatch(r"`\*{0,2}(\w+)`", cells[0])
        if name:
            rows[name.group(1)] = cells[1]
    return rows


MIGRATING = (DOCS / "migrating.md").read_text()
LIGHTNING_ROWS = _table(MIGRATING, "| `FSDPStrategy` argument |")
TORCH_ROWS = _table(MIGRATING, "| torch FSDP keyword |")


def _claims(name: str, row: str) -> list[tuple[Any, bool]]:
    """(value, taken) pairs a row claims: "`True` is accepted ...; `False` is refused" names values; otherwise
    a row starting "not"/"refused" refuses the argument, and any other row takes it."""
    named = re.findall(r"`(True|False|None|\d+)` is (accepted|refused)", row)
    if named:
        return [(ast.literal_eval(value), verdict == "accepted") for value, verdict in named]
    return [(SAMPLES[name], not re.match(r"(not |refused)", row))]


def _build(cls: type, name: str, value: Any) -> None:
    extra: dict[str, Any] = {"sharding_strategy": "HYBRID_SHARD"} if name in HYBRID_ONLY else {}
    cls(**{name: value, **extra})


def test_every_fsdp_argument_has_a_row() -> None:
    lightning = [p for p in inspect.signature(FSDPStrategy.__init__).parameters if p != "self"]
    torch_fsdp = [p for p in inspect.signature(FullyShardedDataParallel.__init__).parameters if p != "self"]
    assert [p for p in lightning if p not in LIGHTNING_ROWS] == []
    covered = set(LIGHTNING_ROWS) | {"module"}
    assert [p for p in torch_fsdp if p not in covered and p not in TORCH_ROWS] == []


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", [*[n for n in LIGHTNING_ROWS if n != "kwargs"], *TORCH_ROWS])
def test_the_row_says_what_the_strategy_does(cls: type, name: str) -> None:
    if name in SHELL_ONLY.get(cls, set()):
        pytest.skip(f"{name} is an argument of the other shell")
    row = {**LIGHTNING_ROWS, **TORCH_ROWS}[name]
    for value, taken in _claims(name, row):
        if taken:
            _build(cls, name, value)
        else:
            with pytest.raises(TypeError, match=rf"(?s){name}=.* is not an option of {cls.__name__}.*HINT"):
                _build(cls, name, value)


def _limits_row() -> str:
    limits = (DOCS / "limits.md").read_text()
    return next(line for line in limits.splitlines() if line.startswith("| an argument `FlatShardStrategy`"))


def test_limits_names_the_refused_arguments_and_the_accepted_ones_apart() -> None:
    cell = _limits_row().split(" | ")[0]
    refused_part, _, accepted_part = cell.partition(";")  # "... refused ones; ... are accepted"
    refused = re.findall(r"`(\w+)(?:=(\w+))?`", refused_part)
    accepted = re.findall(r"`(\w+)(?:=(\w+))?`", accepted_part)
    assert refused and accepted
    for name, value in refused:
        if name == "FlatShardStrategy":
            continue
        given = ast.literal_eval(value) if value else SAMPLES[name]
        with pytest.raises(TypeError, match="not an option of FlatShardStrategy"):
            _build(flatshard.FlatShardStrategy, name, given)
    for name, value in accepted:
        if name in SAMPLES:
            _build(flatshard.FlatShardStrategy, name, ast.literal_eval(value) if value else SAMPLES[name])


def test_troubleshooting_quotes_the_message_the_code_prints() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    refused = {"use_orig_params": False, "device_id": 0, "ignored_modules": SAMPLES["ignored_modules"]}
    for name, value in refused.items():
        assert re.search(rf"`{name}=\S+ is not an option`", text), (
            f"troubleshooting.md does not quote {name}'s error"
        )
        with pytest.raises(TypeError) as err:
            _build(flatshard.FlatShardStrategy, name, value)
        assert re.match(rf"{name}=.+ is not an option of FlatShardStrategy", str(err.value)), str(err.value)
