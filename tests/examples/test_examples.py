"""The examples run as a user runs them, at a tiny size: resuming on other process counts from a consolidated
file and from a sharded directory, and the Fabric loop (meta-device init, bf16, no_sync, sharded save, resume
on 3 processes)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ..scripts import run_script

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> str:
    return run_script(args, cwd, timeout=400).stdout


@pytest.mark.timeout(600)
def test_resume_elsewhere_from_consolidated_file_and_sharded_directory(tmp_path: Path) -> None:
    out = _run(
        ["bash", str(REPO / "examples/checkpoints/resume_elsewhere.sh"), str(tmp_path / "work"), "3"],
        tmp_path,
    )
    assert (tmp_path / "work" / "sharded").is_dir() and (tmp_path / "work" / "full.ckpt").is_file()
    sections = out.split("== ")
    losses = {
        s[:2]: re.findall(r"\[rank (\d)/(\d)\] train_loss=([\d.]+)", s) for s in sections if s[:1].isdigit()
    }
    assert [len(losses[k]) for k in ("1.", "3.", "4.", "5.")] == [2, 1, 3, 3], losses
    # the consolidated file and the sharded directory resume to the same training on 3 processes
    assert losses["4."] == losses["5."], (losses["4."], losses["5."])


@pytest.mark.timeout(600)
def test_fabric_loop_saves_sharded_and_resumes_on_three_processes(tmp_path: Path) -> None:
    script = str(REPO / "examples/fabric/train.py")
    first = _run([sys.executable, script, "--steps", "4", "--ckpt", str(tmp_path / "a")], tmp_path)
    assert "saved a sharded checkpoint" in first and (tmp_path / "a").is_dir()
    second = _run(
        [
            sys.executable,
            script,
            "--devices",
            "3",
            "--steps",
            "6",
            "--resume",
            str(tmp_path / "a"),
            "--ckpt",
            str(tmp_path / "b"),
        ],
        tmp_path,
    )
    assert "resumed at step 4 on 3 processes" in second
    loss = float(re.findall(r"step 6: loss ([\d.]+)", second)[0])
    assert loss < 4.0, second  # below ln(65), a uniform guess: the resumed weights are trained ones
