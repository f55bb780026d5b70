"""LightningCLI: every example config trains (2 processes, launched the way the CLI launches them) and
``fit --ckpt_path`` resumes from the sharded checkpoint directory a config wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..scripts import run_script

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "cli" / "train.py"
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_script([sys.executable, str(SCRIPT), *args], cwd, timeout=240)


def _checkpoint(root: Path) -> Path:
    found = sorted((root / "checkpoints").glob("*.ckpt"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_example_config_trains_and_resumes(config: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    _cli("fit", "--config", str(config), "--trainer.default_root_dir", str(first), cwd=tmp_path)
    ckpt = _checkpoint(first)
    sharded = "sharded" in config.stem
    assert ckpt.is_dir() == sharded, ckpt  # state_dict_type from the YAML took effect
    if not sharded:
        saved = torch.load(ckpt, weights_only=False, map_location="cpu")
        assert saved["global_step"] == 4
        assert all(v.dtype == torch.float32 for v in saved["state_dict"].values() if v.is_floating_point())
    if not sharded:
        return  # resuming from full files is covered by tests/lightning/test_checkpoint.py
    second = tmp_path / "second"
    _cli(
        "fit",
        "--config",
        str(config),
        "--trainer.default_root_dir",
        str(second),
        "--trainer.max_steps",
        "6",
        "--ckpt_path",
        str(ckpt),
        cwd=tmp_path,
    )
    resumed = _checkpoint(second)
    if resumed.is_dir():
        from flatshard import consolidate

        consolidate(resumed, tmp_path / "full.ckpt")
        resumed = tmp_path / "full.ckpt"
    assert torch.load(resumed, weights_only=False, map_location="cpu")["global_step"] == 6
