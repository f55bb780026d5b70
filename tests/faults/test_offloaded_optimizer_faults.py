"""A damaged sharded directory loaded into a model whose optimizer state lives in host memory
(``cpu_offload="optimizer"``, see [Note: optimizer offload]) is refused before anything changes.

The directory is written by 2 gloo ranks training with the optimizer offloaded; copies are damaged the way a bad
copy looks: a data file cut short, a data file missing, a data file whose bytes are garbage (its size intact, so
only the read itself fails, after the ranks agreed the directory is fine), optimizer state whose chunks leave a
gap, optimizer state stored as integers. Each is loaded into another offloaded model after a step, so the host
holds the optimizer state and the copies of the shards and gradient shards. Every case checks the message (the
file or key, the directory, what is wrong), that the weights, the optimizer state and the host buffers are what
they were (the same tensors, in host memory, the parameters on their device pieces), and that the next step
gives exactly what a run that never tried the load gives. The intact directory, loaded the same way, does
change the state: to the saved one. torch's own ``load_state_dict`` refusing a dict whose param groups do not
match leaves the parameters on their device pieces too (in one process).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.checkpoint import CheckpointError
from flatshard.engine import handle_of_param
from flatshard.engine.step.optimizer_offload import existing_plan
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT
from tests.faults.test_damaged_checkpoints import FC, _edit, _same, _snapshot, _step, drop_rank, set_dtype

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

EXP_AVG = f"optimizer_0.state.{FC}.exp_avg"
INTACT = "intact"
# (case, what the message must name: a file or a key, what it must say). A garbled file fails inside torch's
# read, whose error does not say which file: the message names the directory only.
CASES = [
    ("truncated", "__1_0.distcp", "truncated"),
    ("missing", "__0_0.distcp", "missing"),
    ("garbled", None, "could not be read"),
    ("optimizer-gap", FC, "cover"),
    ("optimizer-int", FC, "torch.int32"),
]


def _damage(directory: Path, case: str) -> None:
    data = directory / ("__0_0.distcp" if case == "missing" else "__1_0.distcp")
    if case == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif case == "missing":
        data.unlink()
    elif case == "garbled":
        data.write_bytes(b"\0" * data.stat().st_size)
    elif case == "optimizer-gap":
        _edit(directory, drop_rank(EXP_AVG, 1))
    else:
        _edit(directory, set_dtype(EXP_AVG, torch.int32))


def _offloaded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, cpu_offload="optimizer")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _host_side(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The host buffers and the optimizer's state tensors as they are (copies), and where things live."""
    handles = list({id(h): h for p in model.parameters() if (h := handle_of_param(p)) is not None}.values())
    assert handles and all(h.host is not None for h in handles)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    plan = existing_plan(opt)
    return {
        "host_params": [h.host.params.clone() for h in handles],  # type: ignore[union-attr]
        "host_grads": [h.host.grads.clone() for h in handles],  # type: ignore[union-attr]
        "in_sync": [h.host.in_sync for h in handles],  # type: ignore[union-attr]
        "state": [v.clone() for v in state],
        "state_tensors": [v.data_ptr() for v in state],  # the same tensors, not replaced
        "state_on_host": bool(state) and all(v.device.type == "cpu" for v in state),
        "on_device_pieces": all(
            p.data_ptr() == h.piece(h.index_of(p)).data_ptr()
            for p in model.parameters()
            if (h := handle_of_param(p)) is not None
        ),
        "plan_idle": plan is not None and not plan.on_host and not plan.loading,
    }


def _where(host: dict[str, Any]) -> dict[str, bool]:
    return {k: host[k] for k in ("state_on_host", "on_device_pieces", "plan_idle")}


def _final(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> Any:
    """One more step; the full weights and optimizer state after it."""
    _step(model, opt, rank, world, seed=6)
    return _snapshot(model, opt)


def _try_load(path: str, rank: int, world: int) -> dict[str, Any]:
    model, opt = _offloaded(1)  # other weights than the checkpoint's
    _step(model, opt, rank, world, seed=5)  # optimizer state and host buffers to keep
    before, host_before = _snapshot(model, opt), _host_side(model, opt)
    try:
        flatshard.load_checkpoint(path, model, opt)
        error = None
    except CheckpointError as err:
        error = str(err)
    after, host_after = _snapshot(model, opt), _host_side(model, opt)
    return {
        "error": error,
        "unchanged": _same(before, after),
        "host_unchanged": _same(host_before, host_after),
        "host": host_after,
        "after": after,
        "final": _final(model, opt, rank, world),
    }


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root) / INTACT
    model, opt = _offloaded(0)
    _step(model, opt, rank, world)
    flatshard.save_checkpoint(base, model, opt, state_dict_type="sharded")
    saved = _snapshot(model, opt)
    if rank == 0:
        for name, *_ in CASES:
            shutil.copytree(base, Path(root) / name)
            _damage(Path(root) / name, name)
    dist.barrier()
    never, never_opt = _offloaded(1)  # the run that never tries a load
    _step(never, never_opt, rank, world, seed=5)
    reference = _final(never, never_opt, rank, world)
    results = {
        name: _try_load(str(Path(root) / name), rank, world) for name in [INTACT, *(c[0] for c in CASES)]
    }
    for r in results.values():
        r["same_next_step"] = _same(r.pop("final"), reference)
    results[INTACT]["loaded_saved"] = _same(results[INTACT].pop("after"), saved)
    return results


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("offloaded")
    return {"root": root, "ranks": spawn(_run, 2, str(root))}


@pytest.mark.parametrize(("name", "names", "what"), CASES, ids=[c[0] for c in CASES])
def test_a_damaged_directory_leaves_the_host_state_as_it_was(
    loaded: dict[str, Any], name: str, names: str | None, what: str
) -> None:
    directory = str(loaded["root"] / name)
    for rank, results in enumerate(loaded["ranks"]):
        r = results[name]
        error = r["error"]
        assert error is not None, f"{name}: rank {rank} loaded it"
        assert directory in error and what in error and "HINT:" in error, (name, error)
        assert names is None or names in error, (name, error)
        assert r["unchanged"] and r["host_unchanged"], (name, rank)
        host = r["host"]
        assert all(_where(host).values()), (name, rank, _where(host))
        assert r["same_next_step"], (name, rank)  # training goes on as if the load was never tried


def test_the_intact_directory_loads_into_host_memory(loaded: dict[str, Any]) -> None:
    for rank, results in enumerate(loaded["ranks"]):
        r = results[INTACT]
        assert r["error"] is None, r["error"]
        assert not r["unchanged"] and r["loaded_saved"], rank  # the checks above could see a change
        host = r["host"]
        assert all(_where(host).values()), (rank, _where(host))
        assert not r["same_next_step"], rank


@pytest.mark.parametrize("mismatch", ["another_group", "a_parameter_less"])
def test_torch_refusing_a_state_dict_leaves_the_parameters_in_place(mismatch: str) -> None:
    """torch checks the param groups after the optimizer's load pre-hooks; the offload's pre-hook must not have
    swapped the parameters for host stand-ins by then (its post-hook, which puts them back, never runs)."""
    torch.set_num_threads(1)
    model, opt = _offloaded(1)
    _step(model, opt, 0, 1, seed=5)
    bad = copy.deepcopy(opt.state_dict())
    if mismatch == "another_group":
        bad["param_groups"].append(dict(bad["param_groups"][0]))
    else:
        bad["param_groups"][0]["params"] = bad["param_groups"][0]["params"][:-1]
    before, host_before = _snapshot(model, opt), _host_side(model, opt)
    with pytest.raises(ValueError, match="parameter group"):
        opt.load_state_dict(bad)
    host = _host_side(model, opt)
    assert all(_where(host).values()), _where(host)
    assert _same(before, _snapshot(model, opt)) and _same(host_before, host)
    never, never_opt = _offloaded(1)
    _step(never, never_opt, 0, 1, seed=5)
    assert _same(_final(model, opt, 0, 1), _final(never, never_opt, 0, 1))
