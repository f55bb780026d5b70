"""``benchmarks/gpu_check.py`` on a CPU machine: its two-rank worker runs the same code with ``--device cpu``
(FULL_SHARD, prefetch, limiter, offload, float16 mixed precision against the unsharded reference), and the
check itself, finding no CUDA, writes a summary that says so and succeeds. Both as a user runs them: scripts in
fresh processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ..scripts import run_script

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gpu_check_worker_passes_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    script = REPO / "benchmarks" / "gpu_check_worker.py"
    run_script([sys.executable, str(script), "--device", "cpu", "--steps", "2", "--out", str(out)], REPO, 240)
    report = json.loads(out.read_text())
    assert report["passed"] and report["error"] is None, report
    checks = report["checks"]
    assert all(c["ok"] for c in checks.values()), checks
    # On CPU both runs use the same kernels with one thread each: the same numbers, not just close ones.
    assert checks["weights_vs_reference"]["value"] < 1e-6, checks
    assert checks["losses_vs_reference"]["value"] < 1e-6, checks
    assert len(report["losses"]) == 2 and report["config"]["backend"] == "gloo"
    assert all(n > 0 for n in report["all_gather_bytes_per_rank"]), report


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_gpu_check_without_cuda_writes_a_skipped_summary(tmp_path: Path) -> None:
    done = run_script([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), str(tmp_path)], REPO, 120)
    assert "no CUDA" in done.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["status"] == "skipped: no CUDA", summary
    assert {p["status"] for p in summary["parts"].values()} == {"skipped"}
    assert summary["environment"]["torch"] == torch.__version__
