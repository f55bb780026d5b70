"""Faults during saves: each is reported on every rank within seconds, with its cause, and nothing is lost or left.

Injected on 2 gloo ranks:

* a full disk during a synchronous sharded, an asynchronous sharded and a full save, through the Trainer and
  ``ModelCheckpoint``: on one rank (it covers the checkpoint folder with a full tmpfs in a mount namespace of its
  own, so only its writes fail) and on all ranks (the folder is a small tmpfs that fills up);
* an object store that fails mid-upload (:class:`FlakyStore`, local files behind a URL protocol of its own whose
  writes fail on demand), for the three kinds of save through Fabric;
* kill -9 of a rank during a synchronous sharded save, an asynchronous one and the full-state gather of a full
  save (the workers of ``tests/distributed/test_killed_save.py``, with a small model);
* hidden temporaries that dead runs left beside a checkpoint of another name.

Each case checks that every (surviving) rank raised within ``BOUND_S`` of the fault, naming the cause and the
path; that the previous checkpoint loads and holds what was saved; and that no hidden temporary remains.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import flatshard
from flatshard.checkpoint import CheckpointError, load_checkpoint_file
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from ..distributed._killed_save_worker import file_digests
from ..distributed.test_killed_save import (
    _digest_of,
    _fresh_sharded_model,
    _kill_group,
    _remove_orphaned_semaphores,
)
from ..lightning.lit_common import LitGPT, make_loader, make_trainer

BOUND_S = 30.0  # generous: the failures below arrive within a second or two
WIDTH = 64  # the killed workers' model: 4 x 64 x 64
KINDS: dict[str, dict[str, Any]] = {
    "sharded": {"state_dict_type": "sharded"},
    "async": {"state_dict_type": "sharded", "async_save": True},
    "full": {"state_dict_type": "full"},
}

pytestmark = [
    pytest.mark.skipif(
        sys.platform != "linux", reason="tmpfs mounts, mount namespaces and /proc are Linux's"
    ),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _hidden(names: list[str]) -> list[str]:
    """Hidden temporaries among ``names``: a sharded save's directory or a full file's temporary."""
    return [n for n in names if n.startswith(".") and (".flatshard-" in n or n.endswith(".tmp"))]


def _states_equal(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    return sorted(actual) == sorted(expected) and all(torch.equal(actual[k], v) for k, v in expected.items())


# ---------------------------------------------------------------------------------------------- full disks
_CLONE_NEWNS, _MS_REC, _MS_PRIVATE, _MNT_DETACH = 0x00020000, 1 << 14, 1 << 18, 2


def _libc_call(name: str, *args: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _own_mounts() -> None:
    """Give this thread (and the threads it starts) a mount namespace of its own."""
    _libc_call("unshare", _CLONE_NEWNS)
    _libc_call("mount", b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)


def _mount_tmpfs(folder: Path, size: str) -> None:
    _libc_call("mount", b"tmpfs", str(folder).encode(), b"tmpfs", 0, f"size={size}".encode())


def _fill(folder: Path, leave: int = 0) -> None:
    """Fill the filesystem of ``folder`` up, then free ``leave`` bytes again."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    if leave:
        size = (folder / "filler").stat().st_size
        os.truncate(folder / "filler", max(0, size - leave))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skipped where mounting is not allowed)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    try:
        _mount_tmpfs(folder, "1m")
    except OSError as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}): the full-disk cases need root (CAP_SYS_ADMIN)")
    try:
        yield folder
    finally:
        _libc_call("umount2", str(folder).encode(), _MNT_DETACH)


class _DiskFills(Callback):
    """Records rank 0's full model state when the first checkpoint is saved (``ModelCheckpoint`` runs after this
    callback), then fills the disk before the second: on every rank, or only on ``failing``."""

    def __init__(self, folder: Path, failing: int | None) -> None:
        self.folder, self.failing = folder, failing
        self.saved: dict[str, Any] = {}
        self.at: float | None = None
        self.covered = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 1:
            self.saved = flatshard.get_state_dict(pl_module)[0]
        if trainer.global_step != 2:
            return
        saver = trainer.strategy._core.async_saver
        if saver is not None:
            saver.wait()  # the first checkpoint is complete before the disk fills up
        trainer.strategy.barrier()
        if self.failing is None and trainer.global_rank == 0:
            _fill(self.folder, leave=8192)
        elif self.failing == trainer.global_rank:
            _mount_tmpfs(self.folder, "16k")  # in this rank's own namespace: the others see the real folder
            self.covered = True
            _fill(self.folder)
        trainer.strategy.barrier()
        self.at = time.monotonic()


def _fit_on_a_full_disk(rank: int, world: int, folder: str, kind: str, one_rank: bool) -> dict[str, Any]:
    """``fit`` with a ``ModelCheckpoint`` save every step; the disk fills up before the second."""
    failing = (0 if kind == "full" else 1) if one_rank else None
    fills = _DiskFills(Path(folder), failing)
    trainer = make_trainer(
        world,
        flatshard.FlatShardStrategy(auto_wrap_policy={Block}, **KINDS[kind]),
        max_steps=2,
        callbacks=[fills, ModelCheckpoint(dirpath=folder, filename="model", every_n_train_steps=1)],
        enable_checkpointing=True,
    )
    error = None
    try:
        trainer.fit(LitGPT(), make_loader(3, 6, world))
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    seconds = None if fills.at is None else time.monotonic() - fills.at
    view = sorted(os.listdir(folder))  # what this rank sees (its own full tmpfs, if it covered the folder)
    if fills.covered:
        _libc_call("umount2", folder.encode(), _MNT_DETACH)
    return {"error": error, "seconds": seconds, "saved": fills.saved, "view": view}


def _fits_on_full_disks(rank: int, world: int, one: str, all_: str, kind: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    if rank == (0 if kind == "full" else 1):
        _own_mounts()  # before any thread this rank's writes run in is started
    return [
        _fit_on_a_full_disk(rank, world, one, kind, True),
        _fit_on_a_full_disk(rank, world, all_, kind, False),
    ]


def _assert_holds(path: Path, saved: dict[str, Any], scratch: Path) -> None:
    """``path`` loads, as the checkpoint of step 1 with the model state ``saved``."""
    if path.is_dir():
        flatshard.consolidate(path, scratch / "consolidated.ckpt")
        path = scratch / "consolidated.ckpt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1
    assert _states_equal(ckpt["state_dict"], saved)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["sharded", "async", "full"])
def test_a_full_disk_fails_the_save_on_every_rank(tmp_path: Path, small_disk: Path, kind: str) -> None:
    """On one rank (the writer of a full file, rank 1 otherwise), then on all ranks."""
    try:  # the failing rank mounts in a namespace of its own: check that it may
        subprocess.run(["unshare", "-m", "true"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no mount namespaces here ({err}): the one-rank case needs root (CAP_SYS_ADMIN)")
    folders = {"one rank": tmp_path / "ckpts", "all ranks": small_disk}
    folders["one rank"].mkdir()
    ranks = spawn(_fits_on_full_disks, 2, *map(str, folders.values()), kind, timeout=120)
    for i, (where, folder) in enumerate(folders.items()):
        target = folder / "model.ckpt"
        for rank, results in enumerate(ranks):
            result = results[i]
            error = result["error"]
            assert error is not None, (where, rank)
            assert "No space left on device" in error and str(target) in error, (where, rank, error)
            assert "HINT" in error, (where, rank, error)
            if where == "one rank":
                assert f"on rank {0 if kind == 'full' else 1}" in error, (where, rank, error)
            assert result["seconds"] is not None and result["seconds"] < BOUND_S, (where, rank, result)
            assert not _hidden(result["view"]), (where, rank, result["view"])
        names = sorted(os.listdir(folder))
        assert names == (["model.ckpt"] if where == "one rank" else ["filler", "model.ckpt"]), (where, names)
        _assert_holds(target, ranks[0][i]["saved"], tmp_path)


# ---------------------------------------------------------------------------------------------- object stores
class FlakyStore(LocalFileSystem):
    """An object store for tests: the local files behind ``flaky://``, whose uploads can fail midway.

    ``FlakyStore.fail_uploads(suffix, after)``, in a process: from then on every upload of an object whose name
    ends with ``suffix`` raises a dropped connection after ``after`` writes went through. Local files (rather
    than ``memory://``) because every rank must see the same store.
    """

    protocol = ("flaky",)
    failing: ClassVar[tuple[str, int] | None] = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(auto_mkdir=True, **kwargs)  # an object store has no folders to make first

    @classmethod
    def fail_uploads(cls, suffix: str | None, after: int = 1) -> None:
        cls.failing = None if suffix is None else (suffix, after)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode and self.failing is not None and path.endswith(self.failing[0]):
            return _DroppedUpload(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, block_size, **kwargs)


class _DroppedUpload(LocalFileOpener):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert FlakyStore.failing is not None
        self.left = FlakyStore.failing[1]

    def write(self, data: Any) -> int:
        if self.left <= 0:
            raise OSError(errno.ECONNRESET, "Connection reset by peer (injected mid-upload)")
        self.left -= 1
        return int(super().write(data))


def _register_flaky_store() -> None:
    fsspec.register_implementation("flaky", FlakyStore, clobber=True)


def _fabric_saves_to_a_flaky_store(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    torch.set_num_threads(1)
    _register_flaky_store()
    results: dict[str, Any] = {}
    for kind in KINDS:
        strategy = flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block}, **KINDS[kind])
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(TinyGPT())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        url = f"flaky://{root}/{kind}/ckpt"
        error, seconds, saved, started = None, None, {}, time.monotonic()
        for step in range(2):
            idx, tgt = make_batch(step, 2 * world)
            fabric.backward(model.module.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]))
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:  # the second save's upload fails on one rank (the writer, for a full file)
                if rank == (0 if kind == "full" else 1):
                    FlakyStore.fail_uploads("/ckpt" if kind == "full" else ".distcp")
                started = time.monotonic()
            try:
                fabric.save(url, {"model": model, "optimizer": optimizer, "step": step})
                strategy.wait_for_checkpoint()
            except Exception as err:
                assert step == 1, err  # the first save succeeds
                error, seconds = f"{type(err).__name__}: {err}", time.monotonic() - started
            FlakyStore.fail_uploads(None)
            if step == 0:
                saved = flatshard.get_state_dict(model)[0]
        strategy.teardown()
        results[kind] = {"error": error, "seconds": seconds, "saved": saved}
    return results


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_upload_that_fails_midway_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    _register_flaky_store()
    ranks = spawn(_fabric_saves_to_a_flaky_store, 2, str(tmp_path), timeout=100)
    for kind in KINDS:
        url, folder = f"flaky://{tmp_path}/{kind}/ckpt", tmp_path / kind
        for rank, results in enumerate(ranks):
            result = results[kind]
            error = result["error"]
            assert error is not None, (kind, rank)
            assert "injected mid-upload" in error and url in error and "HINT" in error, (kind, rank, error)
            assert f"on rank {0 if kind == 'full' else 1}" in error, (kind, rank, error)
            assert result["seconds"] < BOUND_S, (kind, rank, result["seconds"])
        saved = ranks[0][kind]["saved"]
        if kind == "full":  # Fabric's full file: the state's own names
            ckpt = load_checkpoint_file(url)
            assert ckpt["step"] == 0 and _states_equal(ckpt["model"], saved), kind
            assert sorted(os.listdir(folder)) == ["ckpt"]
        else:  # the first save's objects, and nothing of the failed one
            torch.manual_seed(1)
            fresh = TinyGPT()
            flatshard.shard(fresh, auto_wrap_policy={Block})
            assert flatshard.load_checkpoint(url, fresh)["step"] == 0, kind
            assert _states_equal(flatshard.get_state_dict(fresh)[0], saved), kind
            names = sorted(os.listdir(folder / "ckpt"))
            data = [n for n in names if n.endswith(".distcp")]
            assert names == sorted([".metadata", "meta.pt", *data]) and len(data) == 2, (kind, names)
            assert len({n.split("_")[3] for n in data}) == 1, (kind, names)  # one save id


# ---------------------------------------------------------------------------------------------- killed ranks
KILLED = {  # case -> (worker, kind argument, --kill)
    "sync sharded save": ("_killed_save_worker.py", ["sharded"], "1:write:2"),
    "async sharded save": ("_killed_async_save_worker.py", [], "1:write:2"),
    "full-state gather": ("_killed_save_worker.py", ["full"], "1:gather:2"),
}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(KILLED))
def test_a_killed_rank_fails_the_save_on_the_others(tmp_path: Path, case: str) -> None:
    worker, kind, kill = KILLED[case]
    ckpts, markers = tmp_path / "ckpts", tmp_path / "markers"
    ckpts.mkdir()
    markers.mkdir()
    path = ckpts / ("model.ckpt" if kind == ["full"] else "model")
    script = Path(__file__).parents[1] / "distributed" / worker
    args = [*kind, str(path), str(markers), "5", "--width", str(WIDTH), "--kill", kill]
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))
    log = markers / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while not (markers / "survivor-0.json").exists():
            assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no report from rank 0:\n{log.read_text()[-4000:]}"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_group(proc)
        _remove_orphaned_semaphores(semaphores)
    survivor = json.loads((markers / "survivor-0.json").read_text())
    error = survivor["error"]
    assert error is not None and str(path) in error, error
    assert "rank 1" in error and "exited" in error and "HINT" in error, error
    assert survivor["seconds"] < BOUND_S, survivor
    assert not _hidden(sorted(os.listdir(ckpts))), sorted(os.listdir(ckpts))
    # save 1 completed, save 2 was killed: the path holds save 1, file for file
    done = json.loads((markers / "done-1.json").read_text())
    expect = json.loads((markers / "expect-1.json").read_text())
    assert file_digests(path) == done["files"]
    model, opt = _fresh_sharded_model(WIDTH)
    assert flatshard.load_checkpoint(path, model, opt) == {"save": 1}
    assert _digest_of(model, opt) == expect["state"]


# ---------------------------------------------------------------------------------------------- leftovers
def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_save_removes_what_dead_runs_left_and_keeps_what_live_ones_write(tmp_path: Path) -> None:
    """Hidden temporaries beside checkpoints of other names: those of processes of this host that are gone go,
    those of live processes and of other hosts (that changed recently) stay."""
    from flatshard.checkpoint import temporaries
    from flatshard.engine import ProcessId

    here = ProcessId.mine()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = dataclasses.replace(here, pid=_exited_pid())
        live = ProcessId.of(sleeper.pid)
        assert live is not None
        elsewhere = dataclasses.replace(here, host="another-host", boot="another-boot")
        for name, owner in {"dead": dead, "live": live, "elsewhere": elsewhere}.items():
            hidden = temporaries.hidden_directory(tmp_path / f"{name}.ckpt")
            hidden.mkdir()
            temporaries.write_owner(hidden, owner)
            (hidden / "__0_0.distcp").write_bytes(b"\0" * 4096)
        stale_file = tmp_path / f".step=3.ckpt.{here.host}-{dead.pid}.k2j4h5g6.tmp"
        stale_file.write_bytes(b"\0" * 4096)
        live_file = tmp_path / f".step=4.ckpt.{here.host}-{sleeper.pid}.a1b2c3d4.tmp"
        live_file.write_bytes(b"\0" * 4096)

        model = torch.nn.Linear(4, 4)
        flatshard.shard(model)
        flatshard.save_checkpoint(tmp_path / "new", model, state_dict_type="sharded")
        assert sorted(os.listdir(tmp_path)) == sorted(
            [".elsewhere.ckpt.flatshard-tmp", ".live.ckpt.flatshard-tmp", live_file.name, "new"]
        )
        flatshard.save_checkpoint(tmp_path / "new.ckpt", model)  # a full save sweeps the folder too
        assert sorted(os.listdir(tmp_path)) == sorted(
            [".elsewhere.ckpt.flatshard-tmp", ".live.ckpt.flatshard-tmp", live_file.name, "new", "new.ckpt"]
        )
        with pytest.raises(CheckpointError, match=f"process {sleeper.pid} on .* is saving to the same path"):
            flatshard.save_checkpoint(tmp_path / "live.ckpt", model, state_dict_type="sharded")
        assert (temporaries.hidden_directory(tmp_path / "live.ckpt") / "__0_0.distcp").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


_KILLED_URL_SAVE = """
import os, signal, sys
import torch
import flatshard
from torch.distributed.checkpoint import filesystem
sys.path.insert(0, {tests!r})
from tests.faults.test_save_faults import _register_flaky_store
_register_flaky_store()
write = filesystem.FileSystemWriter.write_data
def write_then_die(writer, plan, planner):
    os.kill(os.getpid(), signal.SIGKILL)  # the owner object is written, the data upload starts: killed
filesystem.FileSystemWriter.write_data = write_then_die
model = torch.nn.Linear(4, 4)
flatshard.shard(model)
flatshard.save_checkpoint({url!r}, model, state_dict_type="sharded")
"""


def _objects(folder: Path) -> dict[str, list[str]]:
    return {p.name: sorted(os.listdir(p)) for p in sorted(folder.iterdir()) if p.is_dir()}


@pytest.mark.slow
def test_a_save_to_a_url_removes_what_dead_runs_left_beside_it(tmp_path: Path) -> None:
    """At a URL (``flaky://``: local files behind an object-store-like filesystem), a killed run leaves data
    objects and its owner object under its checkpoint's prefix; the next sharded save beside it removes them.
    What live runs write, what another machine wrote recently, a complete checkpoint and objects that are not
    flatshard's stay; what another machine left a day ago goes."""
    from flatshard.checkpoint import temporaries
    from flatshard.engine import ProcessId

    _register_flaky_store()
    root = tmp_path / "run"
    url = f"flaky://{root}"
    model = torch.nn.Linear(4, 4)
    flatshard.shard(model)
    flatshard.save_checkpoint(f"{url}/complete", model, state_dict_type="sharded")
    complete = sorted(os.listdir(root / "complete"))
    assert not any(name.startswith(".flatshard-owner") for name in complete), complete

    # a real kill: a process saving to complete (a re-save), then one to step=1 (a new name), killed mid-upload
    # (the second one's sweep already removes what the first left beside it: saved aside and put back)
    for name in ("complete", "step=1"):
        if name == "step=1":
            (root / "complete").rename(tmp_path / "aside")
        code = _KILLED_URL_SAVE.format(tests=str(Path(__file__).parents[2]), url=f"{url}/{name}")
        killed = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    (tmp_path / "aside").rename(root / "complete")
    left = [n for n in os.listdir(root / "step=1") if n.startswith(".flatshard-owner-")]
    assert left, os.listdir(root / "step=1")  # the killed save's owner object
    assert sorted(os.listdir(root / "complete")) != complete  # its owner object beside the metadata

    here = ProcessId.mine()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = ProcessId.of(sleeper.pid)
        assert live is not None
        elsewhere = dataclasses.replace(here, host="another-host", boot="another-boot")
        day_old = time.time() - temporaries.STALE_AFTER_S - 60
        for name, owner, old in [
            ("live", live, False),
            ("recent", elsewhere, False),
            ("old", elsewhere, True),
        ]:
            (root / name).mkdir()
            (root / name / "__0_a1b2_0.distcp").write_bytes(b"\0" * 64)
            (root / name / ".flatshard-owner-a1b2").write_text(owner.to_json())
            if old:
                for entry in (root / name).iterdir():
                    os.utime(entry, (day_old, day_old))
        (root / "no-owner").mkdir()  # killed before its owner object, a day ago
        (root / "no-owner" / "__0_c3d4_0.distcp").write_bytes(b"\0" * 64)
        os.utime(root / "no-owner" / "__0_c3d4_0.distcp", (day_old, day_old))
        (root / "users").mkdir()  # not flatshard's, however old
        (root / "users" / "__0_c3d4_0.distcp").write_bytes(b"\0" * 64)
        (root / "users" / "notes.txt").write_text("mine")
        for entry in (root / "users").iterdir():
            os.utime(entry, (day_old, day_old))

        flatshard.save_checkpoint(f"{url}/step=2", model, state_dict_type="sharded")
        after = _objects(root)
        assert "step=1" not in after and "old" not in after and "no-owner" not in after, after
        assert after["complete"] == complete, (
            after
        )  # the killed re-save's objects went; the checkpoint stayed
        assert after["live"] == after["recent"] == [".flatshard-owner-a1b2", "__0_a1b2_0.distcp"], after
        assert after["users"] == ["__0_c3d4_0.distcp", "notes.txt"], after
        assert not any(n.startswith(".flatshard-owner") for n in after["step=2"]), after
        fresh = torch.nn.Linear(4, 4)
        flatshard.shard(fresh)
        flatshard.load_checkpoint(f"{url}/complete", fresh)
    finally:
        sleeper.kill()
        sleeper.wait()


def _sharded_checkpoint(path: Path, width: int) -> None:
    """A sharded checkpoint written by one process (no process group): Linear(width, width) and its AdamW."""
    torch.manual_seed(0)
    model = flatshard.shard(torch.nn.Sequential(torch.nn.Linear(width, width)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_consolidate_onto_a_full_disk_fails_and_keeps_the_previous_file(
    tmp_path: Path, small_disk: Path
) -> None:
    """``flatshard consolidate`` streams tensors into the file as it reads them: when the disk fills midway the
    error names the file, the previous file of that name is intact and no temporary is left."""
    _sharded_checkpoint(tmp_path / "small", 16)
    _sharded_checkpoint(tmp_path / "large", 512)  # 1 MiB of weights, 3 MiB with AdamW: more than the disk
    out = small_disk / "full.ckpt"
    flatshard.consolidate(tmp_path / "small", out)
    before = out.read_bytes()
    with pytest.raises(CheckpointError) as raised:
        flatshard.consolidate(tmp_path / "large", out)
    assert "full.ckpt" in str(raised.value) and (
        "No space" in str(raised.value) or "ENOSPC" in str(raised.value)
    )
    assert out.read_bytes() == before
    assert torch.load(out, weights_only=True)["state_dict"]["0.weight"].shape == (16, 16)
    assert sorted(p.name for p in small_disk.iterdir()) == ["full.ckpt"]  # no temporary left
