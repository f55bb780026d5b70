"""Every ``FLATSHARD_*`` switch is read by one module and listed in the guide's one table (see [Note: environment
switches])."""

from __future__ import annotations

import re
from pathlib import Path

import flatshard
from flatshard.engine.transport import env

ROOT = Path(flatshard.__file__).parent
GUIDE = Path(__file__).parents[2] / "docs" / "guide.md"
NAME = re.compile(r"FLATSHARD_[A-Z_]+[A-Z]")


def test_every_switch_is_read_by_the_environment_module_only() -> None:
    known = {*env.FLAGS, *env.INTEGERS, *env.SECONDS}
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "testing":  # the test harness's own switch is not flatshard's
            continue
        text = path.read_text()
        assert set(NAME.findall(text)) <= known, path
        if path != ROOT / "engine" / "transport" / "env.py":
            assert not re.search(r"os\.environ(\.get)?[\[(]\s*[\"']FLATSHARD_", text), (
                f"{path} reads a switch"
            )


def test_the_guide_lists_every_switch_once() -> None:
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `FLATSHARD_")]
    listed = [NAME.search(row).group(0) for row in rows]  # type: ignore[union-attr]
    assert sorted(listed) == sorted({*env.FLAGS, *env.INTEGERS, *env.SECONDS})
