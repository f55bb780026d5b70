"""The desync detector against slow ranks of every kind: none of them is ever reported (see [Note: finding a
desync]), and training matches a run without the fault. Also: frames are told apart by module name, a stale
verdict never fires, different limits on different ranks, and ``FLATSHARD_DESYNC_TIMEOUT`` is validated.
The real desyncs (a skipped step, another unit, an epoch-end reduction) are in tests/distributed/test_desync.py
and tests/lightning/test_desync.py."""

from __future__ import annotations

import copy
import ctypes
import json
import sys
import threading
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine.transport import watchdog
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

from ..lightning.lit_common import LitGPT, make_loader, make_trainer

LIMIT = 2.0  # seconds: short, so that every fault below lasts several times half of it
TRANSPORTS = [pytest.param({}, id="shm"), pytest.param({"FLATSHARD_SHM": "0"}, id="gloo")]


def _train(
    rank: int, world: int, stall: Any, limit: float = LIMIT, steps: int = 3, stall_rank: int = 1
) -> dict[str, Any]:
    """Train a sharded TinyGPT with ``stall()`` run by ``stall_rank`` before step 1's forward (``stall(rank)``
    on every rank if ``stall_rank`` is negative), beside an unsharded reference on the global batch; any error is
    returned, not raised."""
    torch.manual_seed(0)
    reference = TinyGPT()
    model = flatshard.shard(copy.deepcopy(reference), auto_wrap_policy={Block}, desync_timeout=limit)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out: dict[str, Any] = {"error": None}
    try:
        for step in range(steps):
            if step == 1 and rank == stall_rank:
                stall()
            elif step == 1 and stall_rank < 0:  # every rank
                stall(rank)
            idx, tgt = make_batch(step, 2 * world)
            mine = slice(2 * rank, 2 * rank + 2)
            model.loss(idx[mine], tgt[mine]).backward()
            opt.step()
            opt.zero_grad()
            reference.loss(idx, tgt).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    with flatshard.unshard_params(model):
        out["max_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
        )
    out["verdict"] = watchdog.verdict()
    return out


def _assert_healthy(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r)
        assert r["verdict"] is None, (rank, r)
        assert r["max_diff"] < 1e-5, (rank, r)


def _hold_the_gil() -> None:
    # libc's sleep through PyDLL keeps the interpreter lock: no other thread (the heartbeat) runs meanwhile,
    # as in a long pickle.loads or a C extension that does not release it
    ctypes.PyDLL(None).sleep(int(2.5 * LIMIT))


def _make_slowly(seconds: int) -> str:
    ctypes.PyDLL(None).sleep(seconds)  # holds the interpreter lock, as a large unpickling does
    return "unpickled"


class _SlowToUnpickle:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_slowly, (int(2.5 * LIMIT),))


def _broadcast_a_slow_object(rank: int) -> None:
    # rank 1 waits in broadcast_object_list (its heartbeat says so) until rank 0 sends, then unpickles holding
    # the interpreter lock: its last published state is "in a collective", then silence, while rank 0 waits
    # in step 1's all-gather
    box: list[Any] = [_SlowToUnpickle() if rank == 0 else None]
    if rank == 0:
        time.sleep(LIMIT / 2)
    dist.broadcast_object_list(box, src=0)
    assert rank == 0 or box[0] == "unpickled"


def _gil_holder_in_a_collective(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, world, _broadcast_a_slow_object, stall_rank=-1)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_holding_the_interpreter_lock_inside_a_collective_is_never_reported(
    env: dict[str, str],
) -> None:
    _assert_healthy(spawn(_gil_holder_in_a_collective, 2, env=env, timeout=90))


def _gil_holder(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, world, _hold_the_gil)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_holding_the_interpreter_lock_is_never_reported(env: dict[str, str]) -> None:
    _assert_healthy(spawn(_gil_holder, 2, env=env, timeout=90))


def _different_limits(rank: int, world: int) -> dict[str, Any]:
    # rank 0 beats every 0.08 s and reports after 0.5 s; rank 1 beats every 0.67 s: rank 0 must judge rank 1's
    # heartbeat by rank 1's interval, and rank 1's wait by rank 1's limit
    return _train(rank, world, lambda: time.sleep(3.0), limit=1.0 if rank == 0 else 8.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_with_different_limits_never_report_a_slow_rank() -> None:
    _assert_healthy(spawn(_different_limits, 2, timeout=90))


class _SaveSlowlyThenLag(L.Callback):
    """After the first batch, a synchronous sharded save whose DCP writes take 2.5 half-limits (rank 1 longer, so
    rank 0 waits in DCP's own collectives meanwhile: time inside torch.distributed.checkpoint, then every rank
    inside torch.distributed); before the third batch rank 1 is 1 s late. Neither is a desync, and nothing of
    the first may fire in the second."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != 1:
            return
        from torch.distributed.checkpoint import filesystem

        write = filesystem.FileSystemWriter.write_data
        rank = trainer.global_rank

        def slow_write(writer: Any, *a: Any, **k: Any) -> Any:
            time.sleep(2.5 * LIMIT / 2 * (1 + rank))
            return write(writer, *a, **k)

        filesystem.FileSystemWriter.write_data = slow_write  # type: ignore[method-assign]
        try:
            trainer.save_checkpoint(self.directory)
        finally:
            filesystem.FileSystemWriter.write_data = write  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == 2 and trainer.global_rank == 1:
            time.sleep(1.0)


def _fit(world: int, callbacks: list[L.Callback]) -> dict[str, torch.Tensor]:
    model = LitGPT(optimizer="sgd", lr=0.1)
    strategy = flatshard.FlatShardStrategy(
        auto_wrap_policy={Block}, state_dict_type="sharded", desync_timeout=LIMIT
    )
    trainer = make_trainer(world, strategy, max_epochs=1, callbacks=callbacks)
    trainer.fit(model, make_loader(4, 2 * world, world))
    with flatshard.unshard_params(model):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _slow_in_dcp(rank: int, world: int, directory: str) -> dict[str, Any]:
    try:
        faulted = _fit(world, [_SaveSlowlyThenLag(directory)])
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "verdict": watchdog.verdict()}
    plain = _fit(world, [])
    diff = max((faulted[k] - plain[k]).abs().max().item() for k in plain)
    return {"error": None, "verdict": watchdog.verdict(), "max_diff": diff}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_rank_inside_a_long_sharded_save_then_a_late_rank_is_not_a_desync(tmp_path: Any) -> None:
    _assert_healthy(spawn(_slow_in_dcp, 2, str(tmp_path / "ckpt"), timeout=150))
    assert (tmp_path / "ckpt").is_dir()  # the save itself completed


def _stale_verdict(rank: int, world: int) -> dict[str, Any]:
    """A verdict left in the store (an earlier run on the same store, or an earlier wait) names waits that are
    not this run's: a slow rank afterwards is judged afresh, and nothing is raised."""

    def plant_and_lag() -> None:
        store = dist.distributed_c10d._get_default_store()
        old = {"waits": {"0": "dead:1", "1": "dead:2"}, "report": "an old report"}
        store.set("flatshard/desync/verdict", json.dumps(old))
        time.sleep(1.5 * LIMIT)

    return _train(rank, world, plant_and_lag)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_verdict_in_the_store_from_another_wait_never_fires() -> None:
    _assert_healthy(spawn(_stale_verdict, 2, timeout=90))


def test_frames_are_told_apart_by_module_name_not_path() -> None:
    """A torch.distributed collective in a file whose path mentions the project (a virtual environment under a
    folder named like it) is still a collective; a project function in a path that looks like torch's is not."""
    release = threading.Event()
    source = "def {name}(group=None):\n    release.wait()\n"

    def start(module: str, filename: str, name: str) -> threading.Thread:
        namespace: dict[str, Any] = {"__name__": module, "release": release}
        exec(compile(source.format(name=name), filename, "exec"), namespace)
        thread = threading.Thread(target=namespace[name], daemon=True)
        thread.start()
        return thread

    inside = start(
        "torch.distributed.distributed_c10d",
        "/home/u/.cache/flatshard-env/lib/site-packages/torch/distributed/distributed_c10d.py",
        "barrier",
    )
    lookalike = start(
        "flatshard.engine.transport.comm",
        "/opt/site-packages/torch/distributed/distributed_c10d.py",
        "barrier",
    )
    time.sleep(0.2)
    try:
        frames = sys._current_frames()
        found = watchdog._c10d_wait(frames[inside.ident])
        assert found is not None and found[1].startswith("torch.distributed.barrier, called from"), found
        assert watchdog._c10d_wait(frames[lookalike.ident]) is None
    finally:
        release.set()
        inside.join()
        lookalike.join()


@pytest.mark.parametrize("value", ["-5", "60s", "inf", "nan", "sixty"])
def test_a_bad_environment_limit_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FLATSHARD_DESYNC_TIMEOUT", value)
    with pytest.raises(ValueError, match=r"FLATSHARD_DESYNC_TIMEOUT='.*' is not a positive number.*HINT"):
        flatshard.shard(TinyGPT())


@pytest.mark.parametrize(("value", "limit"), [("0", None), ("off", None), (" 30 ", 30.0), ("2.5", 2.5)])
def test_good_environment_limits(monkeypatch: pytest.MonkeyPatch, value: str, limit: float | None) -> None:
    monkeypatch.setenv("FLATSHARD_DESYNC_TIMEOUT", value)
    try:
        flatshard.shard(TinyGPT())
        assert watchdog.limit() == limit
    finally:
        watchdog.configure(watchdog.DEFAULT_LIMIT_S)


# -- the verdict's rule on published states (no processes) ---------------------------------------------------


class _Store:
    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.data = {f"flatshard/desync/{r}": json.dumps(s).encode() for r, s in enumerate(states)}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected: bytes | str, desired: str) -> bytes:
        """As torch's stores: set ``desired`` if the value is ``expected`` (absent: ``""``); the value after."""
        current = self.data.get(key, b"")
        if current == (expected.encode() if isinstance(expected, str) else expected):
            self.data[key] = desired.encode()
        return self.data[key]


def _state(kind: str, **fields: Any) -> dict[str, Any]:
    base = {"beat": 1, "interval": 0.1, "limit": 2.0, "host": "h", "pid": 1, "blocked_s": 5.0, "c10d": {}}
    base.update({"state": kind, "where": kind, "wait": f"w{id(fields)}", "issued": {}}, **fields)
    return base


def _flat(seq: int, issued: list[list[Any]], c10d: int = 0, kind: str = "all_gather") -> dict[str, Any]:
    return _state(
        "flat",
        group=[0, 1],
        name="0",
        seq=seq,
        signature=[kind, 8, "float32"],
        op=kind,
        c10d_seq=c10d,
        issued={"0": issued},
        c10d={"0": c10d},
    )


def _torch(op: str, seq: int, issued_flat: list[list[Any]], c10d: int | None = None) -> dict[str, Any]:
    return _state(
        "collective",
        group=[0, 1],
        name="0",
        op=op,
        c10d_seq=seq,
        issued={"0": issued_flat},
        c10d={"0": seq if c10d is None else c10d},
    )


def _verdict(states: list[dict[str, Any]]) -> str | None:
    store = _Store(states)
    watchdog._evaluate(watchdog.Monitor(), store, 0, len(states), states[0], {})
    found = store.data.get("flatshard/desync/verdict")
    return json.loads(found)["report"] if found else None


AG5 = [5, "all_gather", 8, "float32"]
AG4 = [4, "all_gather", 8, "float32"]


class _PeerDecidesToo(_Store):
    """A peer stores its verdict while this rank reads the states, between its look at the verdict key and its
    own write."""

    def get(self, key: str) -> bytes:
        if key.endswith("/1") and "flatshard/desync/verdict" not in self.data:
            peer = {"waits": {"0": "w0", "1": "w1"}, "report": "flatshard: the peer's report"}
            self.data["flatshard/desync/verdict"] = json.dumps(peer).encode()
        return super().get(key)


def test_ranks_deciding_at_once_adopt_the_first_verdict_stored() -> None:
    """Two ranks may find the desync in the same beat; the first verdict stored is the one every rank raises."""
    states = [_flat(5, [AG4, AG5]), _torch("all_reduce", 3, [AG4])]
    states[0]["wait"], states[1]["wait"] = "w0", "w1"
    store, monitor = _PeerDecidesToo(states), watchdog.Monitor()
    watchdog._evaluate(monitor, store, 0, 2, states[0], {})
    assert json.loads(store.data["flatshard/desync/verdict"])["report"] == "flatshard: the peer's report"
    assert monitor.verdict == "flatshard: the peer's report" and monitor.verdict_wait == "w0"


@pytest.mark.parametrize(
    ("case", "states", "reported"),
    [
        (
            "a rank skipped a step, waits in a barrier",
            [_flat(5, [AG4, AG5]), _torch("all_reduce", 3, [AG4])],
            True,
        ),
        ("both in the same flat collective, in flight", [_flat(5, [AG4, AG5]), _flat(5, [AG4, AG5])], False),
        (
            "the peer issued it and waits on a later one",
            [_flat(5, [AG5]), _flat(6, [AG5, [6, "x", 1, "f"]])],
            False,
        ),
        (
            "the peer issued a different #5",
            [_flat(5, [AG5]), _flat(5, [[5, "reduce_scatter", 8, "float32"]])],
            True,
        ),
        (
            "both in the same torch.distributed call",
            [_torch("broadcast", 7, []), _torch("broadcast", 7, [])],
            False,
        ),
        (
            "torch.distributed calls of different kinds only",
            [_torch("broadcast", 7, []), _torch("all_reduce", 7, [])],
            False,
        ),
        ("a rank is running", [_flat(5, [AG5]), _state("running", blocked_s=0.0)], False),
        (
            "a rank has waited too briefly",
            [_flat(5, [AG5]), _torch("all_reduce", 3, [AG4]) | {"blocked_s": 0.2}],
            False,
        ),
        (
            "the peer issued #3 asynchronously, waits in #4",
            [
                _torch("broadcast", 3, [], c10d=3),
                _torch("all_reduce", 4, [], c10d=4) | {"state": "collective"},
            ],
            False,
        ),
    ],
)
def test_the_verdict_needs_positive_evidence(case: str, states: list[dict[str, Any]], reported: bool) -> None:
    host = states[0]["host"]
    for s in states:
        s["host"] = host
        s["pid"] = __import__("os").getpid()  # alive
    assert (_verdict(states) is not None) == reported, case


def test_an_exited_rank_is_evidence_a_silent_one_is_not() -> None:
    gone = {"state": "exited", "beat": -1}
    assert _verdict([_flat(5, [AG5]), gone]) is not None
    for last in (_torch("all_reduce", 3, [AG4]), _state("running", blocked_s=0.0)):
        silent = last | {"host": "elsewhere"}  # its beat has not advanced for a minute: not known to be gone
        store = _Store([_flat(5, [AG5]), silent])
        peers = {1: watchdog._Peer()}
        peers[1].beat, peers[1].changed = silent["beat"], time.monotonic() - 60.0
        watchdog._evaluate(watchdog.Monitor(), store, 0, 2, _flat(5, [AG5]), peers)
        assert "flatshard/desync/verdict" not in store.data


# -- limits per root ----------------------------------------------------------------------------------------
LONG, SHORT = 8.0, 2.0  # root A (the default group) and root B (a group of its own, sharded last)


def _two_roots(rank: int, world: int, which: str) -> dict[str, Any]:
    torch.manual_seed(0)
    root_a = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, desync_timeout=LONG)
    group_b = dist.new_group([0, 1])
    root_b = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, desync_timeout=SHORT, process_group=group_b)
    idx, _ = make_batch(0, 2)
    out: dict[str, Any] = {"error": None}
    started = time.monotonic()
    try:
        if rank == 0:  # a forward of one root; rank 1 skipped it and waits in a barrier on that root's group
            (root_a if which == "A" else root_b)(idx)
        else:
            dist.barrier(group=None if which == "A" else group_b)
    except RuntimeError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    out["seconds"] = time.monotonic() - started
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["A", "B"])
def test_each_root_keeps_its_own_limit(which: str) -> None:
    """Root B, sharded last with a short limit, does not shorten root A's: a desync in A's collectives is
    reported after half of A's limit, one in B's after half of B's."""
    waiting, _ = spawn(_two_roots, 2, which, timeout=90)
    error = waiting["error"]
    assert error is not None and error.startswith("DesyncError"), waiting
    limit = LONG if which == "A" else SHORT
    assert limit / 2 - 0.5 <= waiting["seconds"] < limit + 2.0, waiting


def _verdict_on_exit(rank: int, world: int) -> dict[str, Any]:
    """A peer's exit with a verdict in the store about an earlier wait of this process (it moved on to its
    next wait before the exit was seen): the verdict is the report. One from another process never is."""
    watchdog.configure(LIMIT)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    for name, ident in (("other", "0badc0de:7"), ("mine", f"{watchdog._NONCE}:1")):
        report = f"flatshard: the ranks' collectives can no longer pair up ({name})"
        store.set("flatshard/desync/verdict", json.dumps({"waits": {"0": ident}, "report": report}))
        try:
            watchdog.raise_verdict_on_exit(RuntimeError("rank 1 exited"))
            out[name] = None
        except watchdog.DesyncError as err:
            out[name] = str(err)
    return out


@pytest.mark.slow
def test_a_peer_exit_reports_the_verdict_about_any_wait_of_this_process() -> None:
    (result,) = spawn(_verdict_on_exit, 1, timeout=60)
    assert result["other"] is None, result
    assert result["mine"] is not None and "(mine)" in result["mine"], result
