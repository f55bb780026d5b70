"""Run a function on N gloo ranks in fresh processes and collect each rank's result.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes (``spawn`` start method), initializes a
process group on a free localhost port, runs ``fn(rank, world_size, *args)`` with one intra-op thread
per rank, and returns the list of per-rank return values. If any rank raises, the first failure is
re-raised in the caller with that rank's traceback; ranks still waiting in a collective are killed.
``fn`` and its arguments must be picklable (module-level functions).

[Note: start method]
Ranks start with the ``spawn`` method by default: a fresh interpreter that imports torch (about 3 s of
CPU per rank). ``FLATSHARD_TEST_START_METHOD=forkserver`` (the test suite sets it) forks them instead from
one server process that imported torch and flatshard once; the caller's current environment is passed
along and applied in each rank. Keep ``spawn`` where a rank must start with settings read at process
start (``MALLOC_*`` for glibc, thread-pool variables): the benchmarks do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "find_free_port", "spawn"]


class DistributedTestError(RuntimeError):
    """A rank of a spawned run failed; the message holds that rank's traceback."""


_PRELOAD = ("torch", "torch.distributed", "flatshard")


def _context(method: str | None) -> Any:
    if method is None:
        method = os.environ.get("FLATSHARD_TEST_START_METHOD", "spawn")
        if method not in ("spawn", "forkserver"):
            raise ValueError(
                f"environment variable FLATSHARD_TEST_START_METHOD={method!r} is not a start method: it accepts "
                "'spawn' (the default) or 'forkserver'. HINT: set FLATSHARD_TEST_START_METHOD=forkserver, or "
                "unset it."
            )
    if method not in ("spawn", "forkserver"):
        raise ValueError(
            f"spawn(start_method={method!r}) is not a start method. HINT: use 'spawn' or 'forkserver'."
        )
    if method not in mp.get_all_start_methods():  # no forkserver on Windows
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))  # only read when the server starts (once per process)
    return ctx


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    whole_env: bool,
    results: Any,
) -> None:
    if whole_env:  # forked from the server: ``env`` is the caller's whole environment
        os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        out = fn(rank, world_size, *args)
        # Plain pickle: tensors travel by value, not as shared memory that dies with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return per-rank results.

    ``env`` is added to each rank's environment; ``start_method`` is ``"spawn"`` or ``"forkserver"``
    (default: ``FLATSHARD_TEST_START_METHOD``, else ``"spawn"``; see [Note: start method]).
    """
    ctx = _context(start_method)
    whole_env = ctx.get_start_method() == "forkserver"
    env = {**os.environ, **(env or {})} if whole_env else dict(env or {})
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, args, env, whole_env, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    try:
        while len(outputs) < world_size and failure is None:
            try:
                rank, ok, payload = results.get(timeout=timeout)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in outputs]
                failure = (
                    dead[0] if dead else -1,
                    f"timed out after {timeout}s (ranks without result: {dead})",
                )
                break
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failure = (rank, payload)
    finally:
        for p in procs:
            p.join(timeout=5 if failure is None else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        rank, tb = failure
        raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [outputs[r] for r in range(world_size)]
