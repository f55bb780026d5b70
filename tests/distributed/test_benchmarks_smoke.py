"""``python -m benchmarks`` end to end, as a user runs it: the smallest scenario on the tiny GPT, 2 ranks, in a
fresh process; its report reads back through the schema, with the loss check passed and the ratio computed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from benchmarks.schema import Report

from ..scripts import run_script

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_scenario_runs_two_ranks_and_writes_its_report(tmp_path: Path) -> None:
    argv = ["train", "--preset", "tiny", "--contenders", "flatshard,ddp", "--steps", "2", "--warmup", "1"]
    done = run_script([sys.executable, "-m", "benchmarks", *argv, "--out", str(tmp_path)], REPO, 240)
    report = Report.from_json((tmp_path / "train_tiny.json").read_text())
    assert report.command == "python -m benchmarks " + " ".join([*argv, "--out", str(tmp_path)])
    assert [r.name for r in report.rows] == ["flatshard", "ddp"] and all(r.ok for r in report.rows)
    flatshard, ddp = report.rows
    assert flatshard.check == {"ok": True, "against": "ddp"} and ddp.check == {"ok": True, "against": "ddp"}
    assert len(flatshard.runs[0]) == 2 and len(flatshard.runs[0][0]["step_s"]) == 2  # 2 ranks, 2 timed steps
    assert flatshard.metrics["all_gather_mib"] > 0 and "all_gather_mib" not in ddp.metrics
    assert report.ratios["flatshard ÷ ddp"]["step_s"] > 0
    assert report.table in done.stdout
    plots = importlib.util.find_spec("matplotlib") is not None  # the `bench` extra
    assert (tmp_path / "train_tiny.png").exists() == plots
