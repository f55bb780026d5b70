"""Every ``FLATSHARD_*`` switch is read by one module and listed in the guide's one table (see [Note: environment
switches])."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import flatshard
from flatshard.engine.transport import env

ROOT = Path(flatshard.__file__).parent
GUIDE = Path(__file__).parents[2] / "docs" / "guide.md"
NAME = re.compile(r"FLATSHARD_[A-Z_]+[A-Z]")


def test_every_switch_is_read_by_the_environment_module_only() -> None:
    known = {*env.FLAGS, *env.SECONDS}
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "testing":  # the test harness's own switch is not flatshard's
            continue
        text = path.read_text()
        removed = set(env.REMOVED) if path == ROOT / "engine" / "transport" / "env.py" else set()
        assert set(NAME.findall(text)) <= known | removed, path
        if path != ROOT / "engine" / "transport" / "env.py":
            assert not re.search(r"os\.environ(\.get)?[\[(]\s*[\"']FLATSHARD_", text), (
                f"{path} reads a switch"
            )


def test_the_guide_lists_every_switch_once() -> None:
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `FLATSHARD_")]
    listed = [NAME.search(row).group(0) for row in rows]  # type: ignore[union-attr]
    assert sorted(listed) == sorted({*env.FLAGS, *env.SECONDS, "FLATSHARD_TEST_START_METHOD"})


def test_a_removed_switch_still_set_gets_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLATSHARD_PREFAULT_THREADS", "4")
    with pytest.warns(UserWarning, match=r"FLATSHARD_PREFAULT_THREADS is no longer read.*HINT: unset it"):
        flatshard.shard(torch.nn.Linear(4, 4))
