"""Running the project's scripts as a user does: a fresh process with none of the spawned ranks' variables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
)


def run_script(
    args: list[str], cwd: Path, timeout: float, fails: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with one thread per process and no inherited rank variables; fail with its output unless
    it exits as expected (0, or non-zero where ``fails``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in _RANK_VARIABLES:
        env.pop(key, None)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert (done.returncode != 0) == fails, f"{args}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done
