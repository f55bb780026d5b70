"""A process killed (SIGKILL) while it saves leaves the previous checkpoint complete and loadable.

``_killed_save_worker.py`` trains a model of ~270 MB on disk (weights + SGD momentum) and saves it to one path
again and again: a full file from one process, or a sharded directory from 2 gloo ranks. The test waits for the
first completed save, then for a later save to be in progress (its temporary file or directory exists and holds
data), kills the whole process group, and checks that the path holds exactly the last completed save: byte for
byte the files the worker recorded after that save, and, loaded into a fresh sharded model, the model and
optimizer state the worker recorded before it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import flatshard
from flatshard.checkpoint import CheckpointError, is_sharded_checkpoint

from ._killed_save_worker import WIDTH, build_model, build_optimizer, file_digests, state_digest

WORKER = Path(__file__).with_name("_killed_save_worker.py")
MAX_SAVES = 30  # the worker stops by itself after this many saves if it is never killed
PARTIAL_BYTES = 8 << 20  # kill once the save in progress has written this much (of ~270 MB)
STARTUP_TIMEOUT_S = 180.0

pytestmark = [
    pytest.mark.slow,
    # DCP's note when the in-process (no process group) save below writes the directory alone
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.skipif(sys.platform != "linux", reason="process groups are killed and watched through /proc"),
]


def _tmp_entries(kind: str, path: Path) -> list[Path]:
    if kind == "full":
        return sorted(path.parent.glob(f".{path.name}.*.tmp"))
    tmp = path.parent / f".{path.name}.flatshard-tmp"
    return [tmp] if tmp.exists() else []


def _bytes_written(entries: list[Path]) -> int:
    total = 0
    for entry in entries:
        try:
            files = list(entry.iterdir()) if entry.is_dir() else [entry]
            total += sum(f.stat().st_size for f in files if f.is_file())
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return total


def _live_members(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (a zombie can no longer write)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            pids.append(int(stat.parent.name))
    return pids


def _mapped_anywhere(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` that a live process maps (a named semaphore is mapped by every process using it;
    ``/proc/PID/maps`` may show it under the temporary name it was created with, so files are matched by
    device and inode)."""
    ids: dict[tuple[str, int], Path] = {}
    for p in paths:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        ids[(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino)] = p
    mapped: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # exited meanwhile, or not readable
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] != "0" and (fields[3], int(fields[4])) in ids:
                mapped.add(ids[(fields[3], int(fields[4]))])
    return mapped


def _remove_orphaned_semaphores(before: set[Path]) -> None:
    """Unlink the named semaphores that appeared since ``before`` and no live process uses: those of a killed
    group, whose multiprocessing resource tracker died with it. A semaphore another process (a concurrent
    test session) still maps is left alone."""
    new = set(Path("/dev/shm").glob("sem.mp-*")) - before
    for leftover in new - _mapped_anywhere(new):
        leftover.unlink(missing_ok=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _live_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _live_members(proc.pid), "processes of the killed worker are still running"


def _run_until_killed_mid_save(kind: str, path: Path, markers: Path) -> dict[str, Any]:
    """Start the worker, kill it during a save after the first one; return what was on disk at that moment."""
    log = markers / "worker.log"
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), kind, str(path), str(markers), str(MAX_SAVES)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the spawned ranks die with it
        )
    try:

        def check_running(what: str) -> None:
            assert proc.poll() is None, (
                f"the worker exited ({proc.returncode}) {what}:\n{log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"timed out {what}:\n{log.read_text()[-4000:]}"

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (markers / "done-0.json").exists():
            check_running("before its first save completed")
            time.sleep(0.02)
        deadline = time.monotonic() + 60
        while _bytes_written(_tmp_entries(kind, path)) < PARTIAL_BYTES:
            check_running("before a later save was seen in progress")
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        _kill_group(proc)
        # The group's multiprocessing resource tracker died with it, so nothing unlinks the named
        # semaphores its ranks created.
        _remove_orphaned_semaphores(semaphores)
    done = sorted(int(p.stem.split("-")[1]) for p in markers.glob("done-*.json"))
    last = done[-1]
    return {
        "last": last,
        "in_progress": last + 1,
        "tmp": _tmp_entries(kind, path),
        "expect": json.loads((markers / f"expect-{last}.json").read_text()),
        "done": json.loads((markers / f"done-{last}.json").read_text()),
        "markers": sorted(p.name for p in markers.iterdir()),
    }


def _fresh_sharded_model(width: int = WIDTH) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Another initialisation, sharded in this process (one rank, the whole model as one unit)."""
    torch.manual_seed(1)
    model = build_model(width)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    flatshard.shard(model)
    return model, build_optimizer(model)


def _digest_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    model_state, optim_state = flatshard.get_state_dict(model, opt)
    return state_digest(model_state, optim_state)


def _check_killed_mid_save(state: dict[str, Any], path: Path) -> None:
    assert state["last"] >= 0
    # The kill hit save `in_progress`: started (its expect marker exists), not completed, its temporary
    # file / directory still there with data in it.
    assert f"expect-{state['in_progress']}.json" in state["markers"], state["markers"]
    assert f"done-{state['in_progress']}.json" not in state["markers"], state["markers"]
    assert state["tmp"] and _bytes_written(state["tmp"]) >= PARTIAL_BYTES, state["tmp"]
    assert not (path.parent / f".{path.name}.flatshard-old").exists()
    # The previous checkpoint is intact: every file byte-identical to what the completed save left.
    assert file_digests(path) == state["done"]["files"]


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A directory for the checkpoints (removed after the test: ~0.5 GB) and one for the markers."""
    ckpts, markers = tmp_path / "ckpts", tmp_path / "markers"
    ckpts.mkdir()
    markers.mkdir()
    yield ckpts, markers
    shutil.rmtree(ckpts, ignore_errors=True)


def _next_save_replaces(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, expected: str, **save_kwargs: Any
) -> None:
    """The next save to ``path`` removes what the dead process left, and loads back as saved."""
    flatshard.save_checkpoint(path, model, opt, extra={"save": "again"}, **save_kwargs)
    assert sorted(os.listdir(path.parent)) == [path.name]
    model2, opt2 = _fresh_sharded_model()
    assert flatshard.load_checkpoint(path, model2, opt2) == {"save": "again"}
    assert _digest_of(model2, opt2) == expected


@pytest.mark.timeout(300)
def test_killed_full_save_keeps_the_previous_file(dirs: tuple[Path, Path]) -> None:
    ckpts, markers = dirs
    path = ckpts / "model.ckpt"
    state = _run_until_killed_mid_save("full", path, markers)
    _check_killed_mid_save(state, path)
    assert path.is_file()

    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["save"] == state["last"]
    assert state_digest(ckpt["state_dict"], ckpt["optimizer_states"][0]) == state["expect"]["state"]
    del ckpt

    model, opt = _fresh_sharded_model()
    assert _digest_of(model, opt) != state["expect"]["state"]
    extra = flatshard.load_checkpoint(path, model, opt)
    assert extra == {"save": state["last"]}
    assert _digest_of(model, opt) == state["expect"]["state"]

    # The half-written temporary file is recognisably not a checkpoint.
    with pytest.raises(CheckpointError, match="could not be read"):
        flatshard.load_checkpoint(state["tmp"][0], *_fresh_sharded_model())

    # The next save to the same path removes the dead process's leftover.
    _next_save_replaces(path, model, opt, state["expect"]["state"])


@pytest.mark.timeout(300)
def test_killed_sharded_save_keeps_the_previous_directory(dirs: tuple[Path, Path]) -> None:
    ckpts, markers = dirs
    path = ckpts / "model"
    state = _run_until_killed_mid_save("sharded", path, markers)
    _check_killed_mid_save(state, path)
    assert is_sharded_checkpoint(path)
    assert sorted(state["done"]["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    (tmp,) = state["tmp"]
    assert not is_sharded_checkpoint(tmp)  # no .metadata: the interrupted save is not a checkpoint

    # Written by 2 ranks with one unit per Linear; read by 1 rank with the whole model as one unit.
    model, opt = _fresh_sharded_model()
    extra = flatshard.load_checkpoint(path, model, opt)
    assert extra == {"save": state["last"]}
    assert _digest_of(model, opt) == state["expect"]["state"]

    # The next save to the same path clears the leftover and replaces the checkpoint.
    _next_save_replaces(path, model, opt, state["expect"]["state"], state_dict_type="sharded")
