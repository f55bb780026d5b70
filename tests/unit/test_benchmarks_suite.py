"""The benchmark suite without processes: the contender registry, the command line of every scenario, the JSON
schema's round trip and checks, and the report's ratios and table."""

from __future__ import annotations

import pytest
import torch
from benchmarks import contenders
from benchmarks.__main__ import parse
from benchmarks.report import Column, compute_ratios, table
from benchmarks.scenarios import SCENARIOS
from benchmarks.schema import Report, Row, file_stem


def _report(rows: list[Row]) -> Report:
    return Report(
        scenario="train",
        preset="cpu-small",
        variant="lora8",
        date="2026-11-28T12:00:00+00:00",
        command="python -m benchmarks train --preset cpu-small --lora 8",
        machine={"cpu_count": 2},
        config={"steps": 10},
        rows=rows,
    )


def _row(name: str, step_s: float, status: str = "ok", **kw: object) -> Row:
    return Row(
        name=name,
        contender=name.split()[0],
        status=status,
        metrics={"step_s": step_s, "peak_rss_mib": [100.0, 120.0]},
        **kw,
    )  # type: ignore[arg-type]


def test_registry_names_families_and_unknown_names() -> None:
    families = {c.family for c in contenders.REGISTRY.values()}
    assert families == {"flatshard", "fsdp1", "fsdp2", "ddp", "unsharded", "hf"}
    assert all(name == c.name and c.description for name, c in contenders.REGISTRY.items())
    with pytest.raises(ValueError, match="HINT: choose from flatshard"):
        contenders.get("fsdp3")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_parses_its_defaults_from_the_registry(scenario: str) -> None:
    mod, args, cfg, names, variant = parse([scenario])
    assert set(mod.CONTENDERS) <= set(contenders.REGISTRY)
    assert names == list(mod.DEFAULT_CONTENDERS) and args.preset == mod.PRESETS[0]
    assert cfg["repeats"] == 1 and variant == ""
    assert {c.key.lstrip("÷/") for c in mod.COLUMNS} and mod.__doc__.strip()


def test_train_options_name_the_variant_and_reach_the_config() -> None:
    argv = "train --preset tiny --contenders flatshard,ddp --repeats 3 --lora 8 --optimizer muon"
    _, _, cfg, names, variant = parse(
        [*argv.split(), "--world-size", "4", "--d-model", "96", "--micro-batches", "2"]
    )
    assert names == ["flatshard", "ddp"] and cfg["repeats"] == 3 and cfg["d_model"] == 96
    assert cfg["world_size"] == 4 and cfg["lora"] == 8 and cfg["overrides"] == {"d_model": 96}
    assert variant == "lora8_muon_m2_w4"
    assert parse(["train", "--variant", "fwd-prefetch"])[4] == "fwd-prefetch"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--contenders", "flatshard,fsdp3"], "unknown \\['fsdp3'\\]. HINT"),
        (["generate", "--contenders", "fsdp2"], "HINT: generate runs unsharded, flatshard"),
        (["train", "--base-dtype", "bf16"], "HINT: give --lora R too"),
        (["train", "--repeats", "0"], "--repeats must be >= 1"),
        (["memory", "--world-sizes", "2,4"], "--world-sizes: 1 and up to 4"),
    ],
)
def test_bad_command_lines_are_refused_with_a_hint(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        parse(argv)


def test_report_round_trips_through_json() -> None:
    rows = [
        _row("flatshard", 0.5, check={"ok": True, "against": "ddp"}, runs=[[{"step_s": [0.5, 0.51]}]]),
        _row("ddp", 1.0),
        Row(name="fsdp2", contender="fsdp2", status="failed", error="RuntimeError: boom"),
    ]
    report = _report(rows)
    report.ratios = compute_ratios(
        rows, ("step_s", "peak_rss_mib"), [("flatshard", "ddp"), ("flatshard", "fsdp2")]
    )
    again = Report.from_json(report.to_json())
    assert again == report and again.stem == "train_cpu-small_lora8" == file_stem(
        "train", "cpu-small", "lora8"
    )
    assert again.ratios == {
        "flatshard ÷ ddp": {"step_s": 0.5, "peak_rss_mib": 1.0}
    }  # no ratio to a failed row
    assert again.row("ddp").metrics["peak_rss_mib"] == [100.0, 120.0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.rows.append(_row("ddp", 2.0)), "row names repeat"),
        (lambda r: setattr(r.rows[0], "status", "meh"), "status 'meh'"),
        (lambda r: setattr(r.rows[0], "status", "failed"), "failed without an error"),
        (lambda r: setattr(r, "variant", "Lora 8"), "variant 'Lora 8'"),
        (lambda r: setattr(r, "command", ""), "command is empty"),
        (lambda r: r.ratios.update({"flatshard ÷ fsdp1": {}}), "names a row that is not in the report"),
    ],
)
def test_schema_violations_are_named(change: object, message: str) -> None:
    report = _report([_row("flatshard", 0.5), _row("ddp", 1.0)])
    change(report)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        report.to_json()
    with pytest.raises(ValueError, match="unknown keys"):
        Report.from_json('{"scenario": "train", "bogus": 1}')


def test_table_and_ratios_leave_out_rows_whose_check_failed() -> None:
    rows = [
        _row("flatshard", 0.5),
        _row("ddp", 1.0),
        _row("fsdp1", 0.25, status="check failed", check={"ok": False, "why": "losses differ"}),
        Row(name="fsdp2", contender="fsdp2", status="failed", error="Traceback...\nRuntimeError: boom"),
    ]
    assert compute_ratios(rows, ("step_s",), [("flatshard", r.name) for r in rows]) == {
        "flatshard ÷ ddp": {"step_s": 0.5}
    }
    text = table(
        rows,
        [Column("step s", "step_s"), Column("RSS", "peak_rss_mib", ".0f"), Column("÷", "÷step_s", ".2f")],
        "flatshard",
    )
    lines = text.splitlines()
    assert (
        lines[2] == "| flatshard | 0.500 | 100 / 120 | 1 |"
        and lines[3] == "| ddp | 1.000 | 100 / 120 | 0.50 |"
    )
    assert "fsdp1 (CHECK FAILED: losses differ)" in lines[4] and lines[4].endswith("| - |")
    assert lines[5] == "| fsdp2 | FAILED: RuntimeError: boom |"


def test_train_float8_option_names_the_variant_and_refuses_lora() -> None:
    _, _, cfg, names, variant = parse(
        ["train", "--preset", "tiny", "--float8", "--contenders", "flatshard,fsdp2"]
    )
    assert cfg["float8"] and names == ["flatshard", "fsdp2"] and variant == "float8"
    assert parse(["train", "--contenders", "flatshard,flatshard_compiled_float8"])[4] == ""
    with pytest.raises(SystemExit, match="HINT: drop --lora or the float8 contenders"):
        parse(["train", "--contenders", "flatshard,fsdp2_float8", "--lora", "8"])


def test_float8_converts_the_same_block_linears_for_every_family() -> None:
    pytest.importorskip("torchao.float8")
    from benchmarks.model import PRESETS, build_model
    from torchao.float8.float8_linear import Float8Linear

    for family, all_gather in (("flatshard", True), ("fsdp2", True), ("fsdp1", False), ("ddp", False)):
        model = build_model(dict(PRESETS["tiny"], seed=0))
        assert contenders.convert_float8(model, family) == 8  # 4 linears in each of the 2 Blocks
        float8 = {
            n: m.config.enable_fsdp_float8_all_gather
            for n, m in model.named_modules()
            if isinstance(m, Float8Linear)
        }
        assert all(n.startswith("blocks.") for n in float8) and set(float8.values()) == {all_gather}
        assert type(model.lm_head) is torch.nn.Linear and model.weights_tied  # the head stays high precision
    with pytest.raises(ValueError, match="HINT: choose --d-model a multiple of 16"):
        contenders.convert_float8(
            build_model(dict(PRESETS["tiny"], d_model=40, n_head=4, seed=0)), "flatshard"
        )


def test_train_pairs_each_flatshard_row_with_its_fsdp2_twin_and_counts_flops() -> None:
    from benchmarks.scenarios import train

    names = ["flatshard", "fsdp2", "flatshard_compiled", "fsdp2_compiled", "flatshard_compiled_float8", "ddp"]
    pairs = train.ratio_pairs([_row(n, 1.0) for n in names])
    assert pairs[: len(names)] == [("flatshard", n) for n in names]
    assert pairs[len(names) :] == [("flatshard_compiled", "fsdp2_compiled")]  # no fsdp2_compiled_float8 row
    cfg = parse(["train", "--preset", "tiny", "--peak-tflops", "2"])[2]
    # torchtitan: 6 x (parameters less the position embedding) + 12 layers d_model seq
    assert train.flops_per_token(1000_000, cfg) == 6 * (1000_000 - 32 * 64) + 12 * 2 * 64 * 32
    assert (
        train.peak_flops(cfg) == 2 * 2e12
        and train.peak_flops(parse(["train", "--preset", "tiny"])[2]) is None
    )


def test_nodes_scope_ring_links_and_link_time() -> None:
    from benchmarks import nodes

    assert nodes.scope([0, 1], 2) == "intra_node" and nodes.scope([0, 2], 2) == "cross_node"
    assert nodes.scope(tuple(range(8)), 4) == "cross_node" and nodes.scope([4, 5, 6, 7], 4) == "intra_node"
    # a ring over W ranks: each link carries (W-1)/W of the full buffer, twice that for an all-reduce
    assert nodes.link_bytes("all_gather", 100, 4) == 300  # the input is one shard of 4
    assert nodes.link_bytes("reduce_scatter", 400, 4) == 300
    assert nodes.link_bytes("all_reduce", 100, 2) == 100 and nodes.link_bytes("all_reduce", 100, 1) == 0
    with pytest.raises(ValueError, match="HINT: one of all_gather"):
        nodes.link_bytes("broadcast", 1, 2)
    # the world ring leaves each node once, shared by the node's ranks; a replicate pair leaves it from each rank
    assert nodes.node_link_share(range(4), 0, 2) == 0.5 and nodes.node_link_share(range(8), 5, 4) == 0.25
    assert nodes.node_link_share([1, 5], 5, 4) == 1.0 and nodes.node_link_share([0, 2, 4, 6], 2, 2) == 1.0
    assert nodes.node_link_share([0, 1], 0, 2) == 0  # never leaves the node
    assert nodes.link_s(25e9 / 8, 25.0) == pytest.approx(1.0)  # 25 Gbit/s: 3.125 GB in one second


class _Group:
    def __init__(self, ranks: list[int]) -> None:
        from collections import Counter

        self.ranks, self.sent = tuple(ranks), Counter()


def test_group_bytes_splits_by_node_and_phase_and_feeds_the_modelled_step() -> None:
    """4 ranks as 2 nodes of 2, rank 0's groups: its node's shard group and the replicate pair {0, 2}."""
    from benchmarks import nodes
    from benchmarks.scenarios.train import node_metrics

    shard, replicate = _Group([0, 1]), _Group([0, 2])

    class Bytes(nodes.GroupBytes):
        @staticmethod
        def _read() -> dict:
            from collections import Counter

            return {g: Counter(g.sent) for g in (shard, replicate)}

    counts = Bytes(0, 2)
    shard.sent["all_gather"] += 2**20
    counts.mark("forward")
    shard.sent.update({"all_gather": 2**20, "reduce_scatter": 4 * 2**20})
    replicate.sent["all_reduce"] += 2 * 2**20
    counts.mark("backward")
    counts.mark("step")  # nothing new
    got = counts.take()
    assert got == {
        "intra_node.forward.all_gather": 2**20,
        "intra_node.backward.all_gather": 2**20,
        "intra_node.backward.reduce_scatter": 4 * 2**20,
        "cross_node.backward.all_reduce": 2 * 2**20,
        "cross_node_link": 2 * 2**20,  # a pair's ring: each link carries the whole all-reduce input
    }
    assert counts.take() == {}
    assert nodes.summed(got, "intra_node") == 6 * 2**20
    assert nodes.summed(got, "intra_node", kind="all_gather") == 2 * 2**20
    assert nodes.summed(got, "cross_node", "forward") == 0
    metrics = node_metrics([got, got], step_s=1.5, gbps=8 * 2**21 / 1e9)  # 2 MiB/s
    assert metrics["intra_node_mib"] == 6 and metrics["cross_node_mib"] == 2
    assert metrics["cross_node_all_reduce_mib"] == 2 and metrics["cross_node_all_gather_backward_mib"] == 0
    assert metrics["link_s"] == pytest.approx(1.0) and metrics["modelled_step_s"] == pytest.approx(2.5)


def test_train_ranks_per_node_options_and_their_refusals() -> None:
    argv = "train --preset tiny --world-size 8 --ranks-per-node 4 --contenders flatshard,flatshard_node_copy"
    _, _, cfg, _, variant = parse(argv.split())
    assert cfg["ranks_per_node"] == 4 and cfg["shard_group_size"] == 4 and cfg["micro_batches"] == 4
    assert cfg["cross_node_gbps"] == 25.0 and variant == "m4_w8_nodes2x4"
    assert parse(["train", "--micro-batches", "2"])[2]["shard_group_size"] == 2
    assert (
        parse(["train", "--world-size", "4", "--ranks-per-node", "2", "--micro-batches", "1"])[4]
        == "w4_nodes2x2"
    )
    assert contenders.get("flatshard_hybrid_no_sync").options == {"strategy": "HYBRID_SHARD", "no_sync": True}
    with pytest.raises(SystemExit, match="HINT: give --ranks-per-node R"):
        parse(["train", "--contenders", "flatshard,flatshard_node_copy"])
    for bad in (["--world-size", "6", "--ranks-per-node", "4"], ["--ranks-per-node", "2"]):
        with pytest.raises(
            SystemExit, match="at least 2 nodes of .* HINT: a --world-size that is a multiple"
        ):
            parse(["train", *bad])
    with pytest.raises(SystemExit, match="must be positive"):
        parse(["train", "--world-size", "4", "--ranks-per-node", "2", "--cross-node-gbps", "0"])
    report = _report([_row("flatshard", 0.5)])
    report.variant = variant  # parts joined by "_" follow the schema
    assert Report.from_json(report.to_json()).stem == "train_cpu-small_m4_w8_nodes2x4"
