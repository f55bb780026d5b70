"""A process killed (SIGKILL) while an asynchronous save is written in the background leaves the previous
checkpoint complete and loadable.

``_killed_async_save_worker.py`` (2 gloo ranks, ~270 MB on disk per save) saves to one path again and again and
trains on while each save is written. The test waits for a save after the first to have returned (training has
gone on) with its hidden directory holding data, kills the whole process group, and checks that the path holds
exactly the save before: byte for byte the files recorded once it completed, and, loaded into a fresh sharded
model, the state recorded before it was saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flatshard
from flatshard.checkpoint import is_sharded_checkpoint

from ._killed_save_worker import file_digests
from .test_killed_save import (
    PARTIAL_BYTES,
    STARTUP_TIMEOUT_S,
    _bytes_written,
    _digest_of,
    _fresh_sharded_model,
    _kill_group,
    _remove_orphaned_semaphores,
    _tmp_entries,
    dirs,  # noqa: F401  (fixture)
)

WORKER = Path(__file__).with_name("_killed_async_save_worker.py")
MAX_SAVES = 30

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.skipif(sys.platform != "linux", reason="process groups are killed and watched through /proc"),
]


def _in_background(markers: Path) -> int | None:
    """A save after the first that has returned and is not yet complete."""
    returned = sorted(int(p.stem.split("-")[1]) for p in markers.glob("returned-*.json"))
    for i in reversed(returned):
        if i >= 1 and not (markers / f"done-{i}.json").exists():
            return i
    return None


@pytest.mark.timeout(300)
def test_killed_async_save_keeps_the_previous_directory(dirs: tuple[Path, Path]) -> None:  # noqa: F811
    ckpts, markers = dirs
    path = ckpts / "model"
    log = markers / "worker.log"
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(path), str(markers), str(MAX_SAVES)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-4000:]}"
            in_flight = _in_background(markers)
            tmp = _tmp_entries("sharded", path)
            if in_flight is not None and _bytes_written(tmp) >= PARTIAL_BYTES:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        _kill_group(proc)
        _remove_orphaned_semaphores(semaphores)

    assert not (markers / f"done-{in_flight}.json").exists()
    previous = in_flight - 1
    (tmp_dir,) = _tmp_entries("sharded", path)
    assert _bytes_written([tmp_dir]) >= PARTIAL_BYTES and not is_sharded_checkpoint(tmp_dir)
    assert not (path.parent / f".{path.name}.flatshard-old").exists()
    done = json.loads((markers / f"done-{previous}.json").read_text())
    expect = json.loads((markers / f"expect-{previous}.json").read_text())
    assert file_digests(path) == done["files"]
    assert sorted(done["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]

    model, opt = _fresh_sharded_model()
    assert flatshard.load_checkpoint(path, model, opt) == {"save": previous}
    assert (
        _digest_of(model, opt) == expect["state"]
    )  # the state at save time, not after the steps that followed
