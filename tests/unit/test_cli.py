"""The flatshard command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from flatshard.checkpoint.files import atomic_save
from flatshard.cli import main
from flatshard.testing.models import TinyGPT


def _ckpt(path: Path) -> Path:
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters())
    model.loss(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)).backward()
    opt.step()
    atomic_save(
        {
            "epoch": 1,
            "global_step": 7,
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
        },
        path,
    )
    return path


def test_inspect_prints_summary(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(_ckpt(tmp_path / "a.ckpt")), "--all"]) == 0
    out = capsys.readouterr().out
    assert "global_step: 7" in out and "blocks.2.out.weight" in out and "exp_avg_sq" in out


def test_inspect_truncated_file_fails_with_message(tmp_path: Path, capsys) -> None:
    path = _ckpt(tmp_path / "a.ckpt")
    path.write_bytes(path.read_bytes()[:100])
    assert main(["inspect", str(path)]) == 2
    assert "a.ckpt" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "flatshard.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout
