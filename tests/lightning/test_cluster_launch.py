"""Training started the way a cluster starts it, not by ``flatshard.testing.spawn``.

* torchrun: two ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d``
  invocations on 127.0.0.1, one per "node" (the c10d rendezvous assigns their node ranks), run
  ``_cluster_train.py``: Lightning's ``TorchElasticEnvironment`` reads the ranks torchrun sets.
* SLURM: four plain ``python`` processes with the variables ``srun --nodes 2 --ntasks-per-node 2`` sets;
  Lightning's ``SLURMEnvironment`` reads them (the main address comes from ``SLURM_NODELIST``).

Each launch fits DDP (the reference), ``flatshard`` (FULL_SHARD over the 4 ranks) and ``flatshard_hybrid``
(default groups: shard within a node of 2, replicate across the 2 nodes) in sequence on the same data;
flatshard must match DDP step by step and in the consolidated checkpoint ``trainer.save_checkpoint`` writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from flatshard.testing import find_free_port

from ..scripts import _RANK_VARIABLES
from .lit_common import assert_same_optimizer_state, assert_same_weights, load_ckpt

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_cluster_train.py")
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS = 3  # the script's default
STRATEGIES = ("ddp", "flatshard", "flatshard_hybrid")
LOSS_TOL = 1e-5
LAUNCH_TIMEOUT = 200.0  # seconds for a whole launch; the script dumps its stacks and exits before that
SCRIPT_DEADLINE = 170.0
FAILURE_GRACE = 20.0  # seconds the other processes get to end once one has failed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available())
        or importlib.util.find_spec("torch.distributed.run") is None,
        reason="torch.distributed (gloo) or its torchrun launcher is not available",
    ),
]


def _clean_env() -> dict[str, str]:
    """This process's environment without any rank / launcher variables (a pytest run inside a real
    torchrun or SLURM job must not leak its own), one thread per process, the repository importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _RANK_VARIABLES
        and k not in ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
        and not k.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_"))
    }
    path = env.get("PYTHONPATH")
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its workers in sessions of their own, so killing
    the launcher's process group would not reach them)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each launched process, its group and everything it started that is still running."""
    for proc in procs:
        if proc.poll() is not None:
            continue
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: its group id is its pid
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _launch(commands: list[tuple[list[str], dict[str, str]]], out: Path, name: str) -> None:
    """Start every ``(argv, env)`` at once, each in its own session with its output in ``out``; wait for
    all of them to succeed. On a failure or past ``LAUNCH_TIMEOUT`` kill them all and fail with the logs."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i, (argv, env) in enumerate(commands):
            logs.append(out / f"{name}.{i}.log")
            with open(logs[-1], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        problem = ""
        while None in (codes := [p.poll() for p in procs]):  # poll every one: each reaps its process
            failed = any(code not in (None, 0) for code in codes)
            if failed:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
            if time.monotonic() > deadline:
                problem = (
                    f"a process failed; the rest were killed {FAILURE_GRACE:.0f}s later"
                    if failed
                    else f"timed out after {LAUNCH_TIMEOUT:.0f}s; killed"
                )
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if problem or any(c != 0 for c in codes):
            _kill(procs)
            report = [f"{name}: {problem or 'failed'}; exit codes {codes}"]
            for (argv, _), log in zip(commands, logs):
                report.append(f"--- {' '.join(argv)}\n{log.read_text(errors='replace')[-6000:]}")
            pytest.fail("\n".join(report), pytrace=False)
    finally:
        _kill(procs)


def _script_args(env_name: str, out: Path) -> list[str]:
    return [
        str(SCRIPT),
        "--env",
        env_name,
        "--strategies",
        ",".join(STRATEGIES),
        "--out",
        str(out),
        "--num-nodes",
        str(NODES),
        "--devices",
        str(PER_NODE),
        "--steps",
        str(STEPS),
        "--deadline",
        str(SCRIPT_DEADLINE),
    ]


def _records(out: Path) -> list[dict[str, Any]]:
    missing = [r for r in range(WORLD) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"no report from ranks {missing}: {sorted(p.name for p in out.iterdir())}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def torchrun_commands(out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """One torchrun per "node", both on 127.0.0.1, meeting at a c10d rendezvous hosted by the first."""
    port, run_id = find_free_port(), f"flatshard-test-{uuid.uuid4().hex[:12]}"
    commands = []
    for invocation in range(NODES):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(PER_NODE),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
            # Both agents would take 127.0.0.1 for their own host; say which one hosts the rendezvous store.
            "--rdzv-conf",
            f"is_host={int(invocation == 0)},join_timeout=120",
            # The address this agent is known by (node rank 0's becomes the workers' MASTER_ADDR).
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "0",
            *_script_args("torchelastic", out),
        ]
        commands.append((argv, {**_clean_env(), "CLUSTER_TEST_INVOCATION": str(invocation)}))
    return commands


def slurm_commands(out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """What ``srun --nodes 2 --ntasks-per-node 2 python _cluster_train.py ...`` starts: one plain process
    per task. ``SLURM_NODELIST`` resolves to 127.0.0.1 (Lightning takes the first host of the range as
    ``MASTER_ADDR``); ``MASTER_PORT`` is given, as Lightning would otherwise derive it from the job id."""
    port = find_free_port()
    common = {
        "SLURM_JOB_ID": "424242",
        "SLURM_JOBID": "424242",
        "SLURM_JOB_NAME": "flatshard-cluster-test",  # not "bash"/"interactive": those turn detection off
        "SLURM_NTASKS": str(WORLD),
        "SLURM_NPROCS": str(WORLD),
        "SLURM_NTASKS_PER_NODE": str(PER_NODE),
        "SLURM_NNODES": str(NODES),
        "SLURM_JOB_NUM_NODES": str(NODES),
        "SLURM_NODELIST": "127.0.0.[1-2]",
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_STEP_NUM_TASKS": str(WORLD),
        "SLURM_STEP_NUM_NODES": str(NODES),
        "MASTER_PORT": str(port),
    }
    commands = []
    for task in range(WORLD):
        node, local = divmod(task, PER_NODE)
        env = {
            **_clean_env(),
            **common,
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": f"127.0.0.{node + 1}",
        }
        commands.append(([sys.executable, *_script_args("slurm", out)], env))
    return commands


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("torchrun")
    _launch(torchrun_commands(out), out, "torchrun")
    return out, _records(out)


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("slurm")
    _launch(slurm_commands(out), out, "slurm")
    return out, _records(out)


def _check_ranks_and_groups(records: list[dict[str, Any]], environment: str) -> None:
    for rank, rec in enumerate(records):
        assert rec["cluster_environment"] == environment, rec["cluster_environment"]
        assert (rec["global_rank"], rec["node_rank"], rec["local_rank"]) == (rank, *divmod(rank, PER_NODE))
        for name in STRATEGIES:
            assert (rec[name]["global_rank"], rec[name]["world_size"]) == (rank, WORLD), (name, rec[name])
        node = rank // PER_NODE
        # Default hybrid groups: every unit sharded over its node's 2 ranks, replicated over the 2 nodes.
        assert rec["flatshard_hybrid"]["groups"] == {
            "worlds": [[PER_NODE, NODES]],
            "shard_nodes": [[node] * PER_NODE],
            "replicate_nodes": [list(range(NODES))],
        }, rec["flatshard_hybrid"]["groups"]
        assert rec["flatshard"]["groups"]["worlds"] == [[WORLD, 1]], rec["flatshard"]["groups"]


def _check_matches_ddp(out: Path, records: list[dict[str, Any]], name: str) -> None:
    reference = records[0]["ddp"]["losses"]
    assert len(reference) == STEPS, reference
    for rec in records:
        for got, want in zip(rec[name]["losses"], reference, strict=True):
            assert abs(got - want) <= LOSS_TOL, (name, rec["global_rank"], rec[name]["losses"], reference)
    ddp, ckpt = load_ckpt(out / "ddp.ckpt"), load_ckpt(out / f"{name}.ckpt")
    assert ckpt["global_step"] == ddp["global_step"] == STEPS, (ckpt["global_step"], ddp["global_step"])
    assert_same_weights(ckpt["state_dict"], ddp["state_dict"], f"{name} vs ddp")
    assert_same_optimizer_state(ckpt["optimizer_states"][0], ddp["optimizer_states"][0], f"{name} vs ddp")


def test_torchrun_two_nodes_rendezvous_and_groups(
    torchrun_run: tuple[Path, list[dict[str, Any]]], record_property: Any
) -> None:
    _, records = torchrun_run
    _check_ranks_and_groups(records, "TorchElasticEnvironment")
    # The rendezvous gave the two invocations node ranks 0 and 1. Which is which is its choice: c10d sorts
    # the agents by (--local-addr, pid), so here the first invocation (the smaller pid) is usually node 0.
    node_of_invocation: dict[str, set[int]] = {}
    for rec in records:
        env = rec["env"]
        assert env["TORCHELASTIC_RUN_ID"] and env["WORLD_SIZE"] == str(WORLD), env
        assert env["LOCAL_WORLD_SIZE"] == str(PER_NODE) and env["GROUP_RANK"] == str(rec["node_rank"]), env
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rec["global_rank"]), str(rec["local_rank"])), env
        node_of_invocation.setdefault(env["CLUSTER_TEST_INVOCATION"], set()).add(rec["node_rank"])
    assert sorted(node_of_invocation) == ["0", "1"], node_of_invocation
    assert sorted(n for nodes in node_of_invocation.values() for n in nodes) == [0, 1], node_of_invocation
    record_property("node_rank_of_invocation", {k: min(v) for k, v in sorted(node_of_invocation.items())})
    assert {rec["main_address"][0] for rec in records} == {"127.0.0.1"}, [r["main_address"] for r in records]


@pytest.mark.parametrize("name", ["flatshard", "flatshard_hybrid"])
def test_torchrun_two_nodes_matches_ddp(torchrun_run: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    _check_matches_ddp(*torchrun_run, name)


def test_slurm_tasks_environment_and_groups(slurm_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, records = slurm_run
    _check_ranks_and_groups(records, "SLURMEnvironment")
    for rec in records:
        assert rec["env"]["RANK"] is None and rec["env"]["LOCAL_WORLD_SIZE"] is None, rec["env"]
        assert rec["env"]["MASTER_ADDR"] is None, rec["env"]
        assert rec["env"]["SLURM_PROCID"] == str(rec["global_rank"]), rec["env"]
    # MASTER_ADDR was not set: Lightning took the first host of SLURM_NODELIST; MASTER_PORT was honoured.
    port = int(records[0]["env"]["MASTER_PORT"])
    addresses = [rec["main_address"] for rec in records]
    assert addresses == [["127.0.0.1", port]] * WORLD, addresses


@pytest.mark.parametrize("name", ["flatshard", "flatshard_hybrid"])
def test_slurm_tasks_match_ddp(slurm_run: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    _check_matches_ddp(*slurm_run, name)
