"""The CPU estimate's runtime (see [Note: a rank's runtime] in ``flatshard/estimator/runtime.py``): measured in
fresh processes, and with it the predicted peak against the real peak RSS of gloo ranks.

The ranks start as fresh interpreters (``spawn``), as launchers start them, and train a few AdamW steps under
``flatshard.shard()`` or the Trainer; their peak RSS is ``VmHWM``, as the benchmarks read it. The estimate must be
within 10% of the largest rank's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch

from flatshard.estimator import estimate, format_table
from flatshard.estimator.dry_run import dry_run
from flatshard.estimator.options import EstimateOptions
from flatshard.estimator.runtime import PARTS, Runtime, factory_path, live_peak, replay
from flatshard.testing import spawn
from flatshard.testing.models import Block
from tests.estimate import rss_models
from tests.estimate.models import gpt

STEPS = 3
MIB = 2**20


def _children() -> set[int]:
    """Processes whose parent is this one."""
    me, out = os.getpid(), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                out.add(int(pid))
    return out


def _leftover_dirs() -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("flatshard-runtime-")]


def _fresh_rss() -> int:
    """VmRSS of a fresh interpreter that imported torch and flatshard."""
    code = "import torch, flatshard; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_runtime_is_measured_and_reported() -> None:
    """Two ranks of a plain model: the parts a fresh process pays, in the table and the JSON; no process or file
    left behind."""
    children, dirs = _children(), _leftover_dirs()
    result = estimate(gpt, 2, device="cpu", auto_wrap_policy={Block})
    (row,) = result.rows
    parts = row.runtime_parts
    assert list(parts) == list(PARTS) and row.runtime == sum(parts.values())
    assert (
        row.peak - row.runtime
        == estimate(gpt, 2, device="cpu", overhead=0, auto_wrap_policy={Block}).rows[0].peak
    )
    fresh = _fresh_rss()
    assert abs(parts["interpreter, torch and flatshard"] - fresh) <= 0.1 * fresh, (parts, fresh)
    assert parts["model imports"] < 5 * MIB  # tests.estimate.models imports nothing heavy
    assert parts["first step"] > 0 and parts["allocator"] >= 0
    assert 0 <= parts["shared-memory channel"] <= 2 * (4 * MIB + 4096)  # two segments of two 2 MiB slots
    assert "runtime (measured)" in format_table(result)
    assert json.loads(result.to_json())["rows"][0]["runtime_parts"] == parts
    assert _children() == children and _leftover_dirs() == dirs


def test_the_channel_part_follows_the_world_size() -> None:
    """Measured at two ranks: a segment per rank of each group (see [Note: a rank's runtime])."""
    measured = Runtime(
        base=dict.fromkeys(PARTS[:4], 1), channel_segment=10, segments=2, processes=2, allocator=[5]
    )
    assert measured.parts(0, 0)["shared-memory channel"] == 0  # one rank: no channel
    assert measured.parts(8, 0)["shared-memory channel"] == 80
    assert measured.parts(8, None)["allocator"] == 0  # no step logged (no batch)
    assert sum(measured.parts(2, 0).values()) == 4 + 20 + 5


def test_factories_are_found_by_import_path() -> None:
    assert factory_path(rss_models.mlp) == "tests.estimate.rss_models:mlp"
    assert factory_path("pkg.mod:build") == "pkg.mod:build"
    assert factory_path(lambda: rss_models.mlp()) is None  # a fresh process cannot import it


def test_the_logged_step_holds_what_the_tracker_measured() -> None:
    """The log the runtime replays is the measured step: its live bytes peak where the tracker's did."""
    opts = EstimateOptions(world_sizes=(2,), device="cpu")
    m = dry_run(gpt, "gpt", opts, 2, None, log_allocations=True)
    assert m.peak is not None and live_peak(m.allocations) == m.peak
    blocks = [n for _, n, mapped in m.allocations if mapped and n > 0]
    assert blocks  # the gathered units, the gradients: the engine's own blocks
    small = [(0, 1 * MIB, False), (1, 2 * MIB, True), (0, -1, False), (1, -1, False)]
    assert live_peak(small) == 3 * MIB
    assert replay([MIB], small, lambda n: torch.empty(n, dtype=torch.uint8), passes=2) >= 0


def _compare(what: str, row: Any, ranks: list[dict[str, Any]]) -> None:
    """The predicted peak within 10% of the largest rank's peak RSS; the numbers printed (``-s``) for the docs."""
    real = max(r["VmHWM"] for r in ranks)
    parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in row.runtime_parts.items())
    summary = (
        f"{what}: predicted {row.peak / MIB:.0f} MiB (tensors {(row.peak - row.runtime) / MIB:.0f}, runtime "
        f"{row.runtime / MIB:.0f}: {parts}), ranks peaked at {[round(r['VmHWM'] / MIB) for r in ranks]} MiB, "
        f"ratio {row.peak / real:.3f}"
    )
    print(summary)
    assert abs(row.peak - real) <= 0.10 * real, summary


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["hf_llama", "hf_gpt2", "mlp"])
def test_the_cpu_estimate_predicts_the_ranks_peak_rss(model: str) -> None:
    factory = rss_models.FACTORIES[model]
    t0 = time.perf_counter()
    row = estimate(factory, 2, device="cpu", auto_wrap_policy=rss_models.wrap(model)).rows[0]
    print(f"{model}: the estimate took {time.perf_counter() - t0:.0f} s")
    ranks = spawn(rss_models.shard_rank, 2, model, STEPS, start_method="spawn")
    _compare(f"shard(), {model}", row, ranks)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cpu_estimate_predicts_a_trainer_ranks_peak_rss() -> None:
    from tests.estimate import rss_trainer

    row = estimate(
        rss_trainer.hf_gpt2_in_lightning, 2, device="cpu", auto_wrap_policy=rss_models.wrap("hf_gpt2")
    ).rows[0]
    ranks = spawn(rss_trainer.trainer_rank, 2, "hf_gpt2", STEPS, start_method="spawn")
    assert all(r["steps"] == STEPS for r in ranks)
    _compare("Trainer, hf_gpt2", row, ranks)
