"""``python -m benchmarks`` end to end, as a user runs it: the smallest scenario on the tiny GPT, 2 ranks, in a
fresh process; its report reads back through the schema, with the loss check passed and the ratio computed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from benchmarks.schema import Report

from ..scripts import run_script

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_scenario_runs_two_ranks_and_writes_its_report(tmp_path: Path) -> None:
    argv = ["train", "--preset", "tiny", "--contenders", "flatshard,ddp", "--steps", "2", "--warmup", "1"]
    done = run_script([sys.executable, "-m", "benchmarks", *argv, "--out", str(tmp_path)], REPO, 240)
    report = Report.from_json((tmp_path / "train_tiny.json").read_text())
    assert report.command == "python -m benchmarks " + " ".join([*argv, "--out", str(tmp_path)])
    assert [r.name for r in report.rows] == ["flatshard", "ddp"] and all(r.ok for r in report.rows)
    flatshard, ddp = report.rows
    assert flatshard.check == {"ok": True, "against": "ddp"} and ddp.check == {"ok": True, "against": "ddp"}
    assert len(flatshard.runs[0]) == 2 and len(flatshard.runs[0][0]["step_s"]) == 2  # 2 ranks, 2 timed steps
    assert flatshard.metrics["all_gather_mib"] > 0 and "all_gather_mib" not in ddp.metrics
    assert report.ratios["flatshard ÷ ddp"]["step_s"] > 0
    assert report.table in done.stdout
    plots = importlib.util.find_spec("matplotlib") is not None  # the `bench` extra
    assert (tmp_path / "train_tiny.png").exists() == plots


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_float8_rows_run_and_agree_with_each_other(tmp_path: Path) -> None:
    """flatshard and FSDP2 with torchao's float8 training on the tiny GPT: both rows pass the loss check against
    each other (the same float8 math), flatshard gathers the Block weights in float8, and each float8 row is
    compared with its FSDP2 twin."""
    pytest.importorskip("torchao.float8")
    argv = ["train", "--preset", "tiny", "--contenders", "flatshard,flatshard_float8,fsdp2_float8"]
    argv += ["--steps", "2", "--warmup", "1", "--variant", "float8-smoke"]
    run_script([sys.executable, "-m", "benchmarks", *argv, "--out", str(tmp_path)], REPO, 240)
    report = Report.from_json((tmp_path / "train_tiny_float8-smoke.json").read_text())
    plain, ours, theirs = report.rows
    assert all(r.ok for r in report.rows), [(r.name, r.error, r.check) for r in report.rows]
    assert [r.metrics["float8"] for r in report.rows] == [False, True, True]
    assert plain.check["against"] == "flatshard" and theirs.check == {
        "ok": True,
        "against": "flatshard_float8",
    }
    assert ours.runs[0][0]["losses"] == pytest.approx(theirs.runs[0][0]["losses"], abs=1e-5)
    assert ours.runs[0][0]["losses"] != plain.runs[0][0]["losses"]
    # float8 all-gathers: 1 byte instead of 4 for each Block linear weight (2 Blocks of 49152); rank 0 passes
    # its half of them twice a step (forward and backward)
    saved = (plain.metrics["all_gather_mib"] - ours.metrics["all_gather_mib"]) * 2**20
    assert saved == pytest.approx(3 * 2 * (2 * 49152 // 2))
    assert "flatshard_float8 ÷ fsdp2_float8" in report.ratios


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_cross_node_rows_on_two_nodes_of_two(tmp_path: Path) -> None:
    """4 ranks as 2 nodes x 2, 4 micro-batches: every row agrees with DDP's losses; the hybrid row that syncs once
    per optimizer step sends 1/4 of the cross-node all-reduce bytes of the one that syncs every micro-batch; the
    node-local copy gathers nothing across nodes in backward; the modelled step adds the link time."""
    rows = "flatshard,flatshard_node_copy,flatshard_hybrid,flatshard_hybrid_no_sync,ddp"
    argv = ["train", "--preset", "tiny", "--world-size", "4", "--ranks-per-node", "2", "--contenders", rows]
    argv += ["--steps", "1", "--warmup", "0"]
    run_script([sys.executable, "-m", "benchmarks", *argv, "--out", str(tmp_path)], REPO, 540)
    report = Report.from_json((tmp_path / "train_tiny_m4_w4_nodes2x2.json").read_text())
    assert all(r.ok and r.check["against"] == "ddp" for r in report.rows), [
        (r.name, r.check) for r in report.rows
    ]
    full, copy, every, once, ddp = (r.metrics for r in report.rows)
    assert once["cross_node_all_reduce_mib"] * 4 == every["cross_node_all_reduce_mib"] > 0
    assert once["intra_node_mib"] == every["intra_node_mib"] > 0  # every micro-batch still reduce-scatters
    assert full["cross_node_all_gather_backward_mib"] > 0 and full["intra_node_mib"] == 0
    assert copy["cross_node_all_gather_backward_mib"] == 0 and copy["intra_node_mib"] > 0
    assert copy["cross_node_all_gather_forward_mib"] == full["cross_node_all_gather_forward_mib"]
    for m in (full, copy, every, once):
        assert m["modelled_step_s"] == pytest.approx(m["step_s"] + m["link_s"]) and m["link_s"] > 0
    assert "cross_node_mib" not in ddp  # DDP is the loss reference; its reducer is not counted
    assert report.ratios["flatshard ÷ flatshard_hybrid_no_sync"]["cross_node_mib"] > 1
    assert "modelled step s" in report.table


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tensor_parallel_scenario_runs_both_contenders_on_a_2x2_mesh(tmp_path: Path) -> None:
    """4 ranks as 2 (data parallel) x 2 (tensor parallel), the tiny Llama, one step and a sharded save each:
    flatshard's and FSDP2's rows agree in losses and saved weights, both count the same tensor-parallel bytes, each
    counts its data-parallel bytes, and the ratio flatshard ÷ FSDP2 is computed."""
    argv = ["tensor_parallel", "--preset", "tiny", "--steps", "1", "--warmup", "0"]
    done = run_script([sys.executable, "-m", "benchmarks", *argv, "--out", str(tmp_path)], REPO, 400)
    report = Report.from_json((tmp_path / "tensor_parallel_tiny.json").read_text())
    assert [r.name for r in report.rows] == ["flatshard_tp", "fsdp2_tp"]
    assert all(r.ok for r in report.rows), [(r.name, r.error, r.check) for r in report.rows]
    ours, theirs = report.rows
    assert theirs.check == {"ok": True, "against": "flatshard_tp", "saved": "ok"}
    assert theirs.metrics["loss_diff"] <= 1e-4 and theirs.metrics["saved_weight_diff"] <= 1e-3
    assert (
        len(ours.runs[0]) == 4 and len(ours.runs[0][0]["losses"]) == 2
    )  # 4 ranks; the step and the counted one
    assert ours.metrics["tp_mib"] == theirs.metrics["tp_mib"] > 0  # the same plan moves the same bytes
    assert ours.metrics["dp_mib"] > 0 and theirs.metrics["dp_mib"] > 0
    assert ours.metrics["own_tp_mib"] == 0  # flatshard shards over data_parallel only
    assert {"step_s", "peak_rss_mib", "save_s", "dp_mib", "tp_mib"} <= set(
        report.ratios["flatshard_tp ÷ fsdp2_tp"]
    )
    assert report.table in done.stdout


def test_tensor_parallel_mesh_option_names_the_variant_and_refuses_what_the_plan_cannot_split() -> None:
    from benchmarks.__main__ import parse

    _, _, cfg, names, variant = parse(["tensor_parallel", "--preset", "tiny", "--mesh", "1x4"])
    assert names == ["flatshard_tp", "fsdp2_tp"] and cfg["mesh"] == [1, 4] and cfg["world_size"] == 4
    assert variant == "mesh1x4" and parse(["tensor_parallel", "--preset", "tiny"])[4] == ""
    with pytest.raises(SystemExit, match="--n-kv-head 4.*HINT: sizes divisible by 8"):
        parse(["tensor_parallel", "--preset", "tiny", "--mesh", "1x8"])
    with pytest.raises(SystemExit, match="give DPxTP"):
        parse(["tensor_parallel", "--mesh", "2by2"])
    with pytest.raises(SystemExit, match="HINT: tensor_parallel runs flatshard_tp, fsdp2_tp"):
        parse(["tensor_parallel", "--contenders", "flatshard"])
    with pytest.raises(SystemExit, match="unknown \\['flatshard_tp'\\]"):
        parse(
            ["train", "--contenders", "flatshard_tp"]
        )  # the GPT scenarios do not offer the Llama's contenders
