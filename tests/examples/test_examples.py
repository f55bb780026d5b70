"""The examples run as a user runs them, at a tiny size: resuming on other process counts from a consolidated
file and from a sharded directory, and the Fabric loop (meta-device init, bf16, no_sync, sharded save, resume
on 3 processes)."""

from __future__ import annotations

import re
import sys
import zlib
from pathlib import Path

import pytest

from ..scripts import run_script

pytestmark = pytest.mark.slow

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


def _degenerate(sample: str) -> str | None:
    """Why ``sample`` reads as a broken model (a loop of a few characters or words), or None."""
    words = re.findall(r"[A-Za-z']+", sample)
    if len(set(words)) < 15:
        return f"{len(set(words))} distinct words"
    if len(zlib.compress(sample.encode())) < 0.4 * len(sample.encode()):  # text compresses to ~0.55
        return "it compresses like a repeated pattern"
    if re.search(r"(.{1,6})\1{3,}", sample):
        return "a pattern repeated four times in a row"
    return None


@pytest.mark.timeout(600)
def test_the_default_example_shows_text_the_loss_and_what_each_rank_holds(tmp_path: Path) -> None:
    """The first command of the README, shorter (300 of its 1000 steps): a sample that reads as text, the
    validation loss far below a uniform guess's, and each rank holding half of an unsharded process's bytes."""
    out = _run([sys.executable, str(REPO / "examples/gpt/train.py"), "--max-steps", "300"], tmp_path)
    sample = out.split("---\n", 1)[1].split("\n--- end of sample", 1)[0]
    assert sample.startswith("MACBETH:\n") and _degenerate(sample) is None, (_degenerate(sample), sample)
    val, uniform = map(float, re.findall(r"val_loss ([\d.]+) nats/character; .* scores ([\d.]+)", out)[0])
    assert val < uniform - 1.5, out
    assert re.search(r"300 steps in \d+ s on 2 processes: [\d,]+ characters/s", out), out
    whole = dict(re.findall(r"(param|grad|optim)_mib=([\d.]+)", out.split("would hold", 1)[1].split("\n")[0]))
    for rank in ("0", "1"):
        line = re.findall(rf"\[rank {rank}/2\] .*", out)[0]
        held = dict(re.findall(r"(param|grad|optim)_mib=([\d.]+)", line))
        for kind in ("param", "grad", "optim"):  # half, and a little padding
            assert 0.45 < float(held[kind]) / float(whole[kind]) < 0.6, (kind, line, whole)
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written where it ran


def test_a_failed_resume_says_why_once_per_rank(tmp_path: Path) -> None:
    """A damaged checkpoint given to the example's resume: each rank prints one traceback ending in the one
    message that names the file and the fix, not a chain of causes repeating it."""
    script = str(REPO / "examples/gpt/train.py")
    tiny = ["--d-model", "32", "--n-layer", "1", "--batch-size", "4"]
    _run(
        [sys.executable, script, "--max-steps", "2", "--ckpt-out", str(tmp_path / "a.ckpt"), *tiny], tmp_path
    )
    data = (tmp_path / "a.ckpt").read_bytes()
    (tmp_path / "a.ckpt").write_bytes(data[: len(data) // 2])
    done = run_script(
        [sys.executable, script, "--max-steps", "4", "--resume", str(tmp_path / "a.ckpt"), *tiny],
        tmp_path,
        timeout=400,
        fails=True,
    )
    out = done.stdout + done.stderr
    assert out.count("Traceback (most recent call last)") <= 2, out
    assert "The above exception was the direct cause" not in out, out
    assert "During handling of the above exception" not in out, out
    messages = re.findall(r"CheckpointError: (.*)", out)
    assert len(messages) == 2 and all("a.ckpt" in m and "HINT" in m for m in messages), out
