"""``flatshard.load_pretrained``: a Hugging Face checkpoint into a meta-built, sharded model, each rank reading
only its pieces, compared with ``from_pretrained`` (weights, buffers, logits)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.testing import spawn

from .pretrained_common import BLOCK, meta_model, reference, tokens, write_checkpoint

torch.set_num_threads(1)


def _data_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * torch.empty((), dtype=getattr(torch, _ST_DTYPES[t.get_dtype()])).element_size()
    return total


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _compare(model: nn.Module, path: Path, dtype: torch.dtype | None = None) -> dict[str, Any]:
    ref = reference(path, dtype)
    x = tokens()
    with torch.no_grad():
        mine = model(x).logits.float()
        theirs = ref(x).logits.float()
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    same = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    buffers = {n: b for n, b in model.named_buffers()}
    inv = [n for n in buffers if n.endswith("inv_freq")]
    ref_buffers = dict(ref.named_buffers())
    return {
        "logits": float((mine - theirs).abs().max()),
        "state_equal": same,
        "buffers_equal": all(torch.equal(buffers[n], ref_buffers[n]) for n in inv) and bool(inv),
    }


def _sharded_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    cases = [
        ("multi/FULL_SHARD", "multi", "FULL_SHARD", False, None),
        ("multi/SHARD_GRAD_OP", "multi", "SHARD_GRAD_OP", False, None),
        ("single/NO_SHARD", "single", "NO_SHARD", False, None),
        ("tied/FULL_SHARD", "tied", "FULL_SHARD", True, None),
        ("bin/FULL_SHARD", "bin", "FULL_SHARD", False, None),
        ("multi/bf16", "multi", "FULL_SHARD", False, torch.bfloat16),
    ]
    for name, ckpt, strategy, tie, dtype in cases:
        model = meta_model(tie, dtype)
        flatshard.shard(model, sharding_strategy=strategy, auto_wrap_policy={BLOCK})
        with pytest.raises(flatshard.UnfilledError, match="embed_tokens"):
            model(tokens())
        result = flatshard.load_pretrained(model, base / ckpt)
        out[name] = _compare(model, base / ckpt, dtype)
        out[name]["bytes_read"] = result.bytes_read
        out[name]["missing"] = result.missing
        if tie:
            out[name]["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    # Rank 0 holds the model (from_pretrained), the others build it on the meta device: sync_module_states
    # broadcasts rank 0's values, and what is unfilled is rank 0's (nothing).
    model = reference(base / "multi") if rank == 0 else meta_model()
    flatshard.shard(model, auto_wrap_policy={BLOCK}, sync_module_states=True)
    out["sync_module_states"] = _compare(model, base / "multi")
    out["sync_module_states"].update(bytes_read=0, missing=[])
    # A unit holding two dtypes: the norms in fp32, the rest in bf16 (two flat parameters per unit).
    model = meta_model(False, torch.bfloat16)
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.float()
    flatshard.shard(model, auto_wrap_policy={BLOCK})
    flatshard.load_pretrained(model, base / "multi")
    norm = model.model.layers[0].input_layernorm.weight
    ref = reference(base / "multi")
    with flatshard.unshard_params(model):
        out["mixed_dtypes"] = {
            "norm_dtype": str(norm.dtype),
            "norm_equal": torch.equal(norm, ref.model.layers[0].input_layernorm.weight),
            "proj_equal": torch.equal(
                model.model.layers[1].mlp.up_proj.weight, ref.model.layers[1].mlp.up_proj.weight.bfloat16()
            ),
        }
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    write_checkpoint(root / "multi", max_shard_size="20KB")
    write_checkpoint(root / "single")
    write_checkpoint(root / "tied", tie=True, max_shard_size="20KB")
    write_checkpoint(root / "bin", safe=False, max_shard_size="20KB")
    return root


@pytest.mark.timeout(300)
def test_sharded_load_matches_from_pretrained(checkpoints: Path) -> None:
    assert len(json.loads((checkpoints / "multi" / "model.safetensors.index.json").read_text())["weight_map"])
    assert len(list((checkpoints / "multi").glob("*.safetensors"))) > 2
    results = spawn(_sharded_cases, 2, str(checkpoints))
    total = _data_bytes(checkpoints / "multi")
    for r in results:
        for case, v in r.items():
            if case == "mixed_dtypes":
                assert v == {"norm_dtype": "torch.float32", "norm_equal": True, "proj_equal": True}, v
                continue
            assert v["state_equal"] and v["buffers_equal"], (case, v)
            assert v["logits"] < (2e-2 if "bf16" in case else 1e-5), (case, v)
            assert v["missing"] == [], (case, v)
            if case.startswith("tied"):
                assert v["tied"], case
    # Each rank reads only its own pieces: under FULL_SHARD the two ranks' reads add up to the checkpoint.
    reads = [r["multi/FULL_SHARD"]["bytes_read"] for r in results]
    assert sum(reads) == total and max(reads) < 0.6 * total, (reads, total)
    # NO_SHARD keeps everything on every rank, so each reads it all.
    assert all(r["single/NO_SHARD"]["bytes_read"] == total for r in results)


def test_unsharded_meta_model_and_prefix(checkpoints: Path) -> None:
    class Lit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = meta_model()
            self.head = nn.Linear(2, 2)

    lit = Lit()
    result = flatshard.load_pretrained(lit, checkpoints / "multi", prefix="model.")
    assert not any(t.is_meta for t in lit.parameters()) and result.missing == []
    ref = reference(checkpoints / "multi")
    for k, v in ref.state_dict().items():
        assert torch.equal(lit.model.state_dict()[k], v), k
    assert torch.equal(lit.model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    with torch.no_grad():
        torch.testing.assert_close(lit.model(tokens()).logits, ref(tokens()).logits)
    # A single .safetensors file given directly, and the index file given directly.
    single = meta_model()
    flatshard.load_pretrained(single, checkpoints / "single" / "model.safetensors")
    index = meta_model()
    flatshard.load_pretrained(index, checkpoints / "multi" / "model.safetensors.index.json")
    assert all(torch.equal(a, b) for a, b in zip(single.state_dict().values(), index.state_dict().values()))


def test_mismatches_fail_before_any_weight_changes(checkpoints: Path, tmp_path: Path) -> None:
    model = meta_model()
    flatshard.shard(model, auto_wrap_policy={BLOCK})
    flatshard.load_pretrained(model, checkpoints / "multi")
    before, _ = flatshard.get_state_dict(model)
    # Another checkpoint of other values: used below to prove nothing was read from it when it fails.
    other = write_checkpoint(tmp_path / "other", seed=1, max_shard_size="20KB")
    # A prefix no name has; a checkpoint whose names differ (strict: both lists named).
    with pytest.raises(flatshard.CheckpointError, match="prefix 'x.'.*HINT"):
        flatshard.load_pretrained(model, other, prefix="x.")
    from safetensors.torch import load_file, save_file

    renamed = load_file(checkpoints / "single" / "model.safetensors")
    renamed["model.final_norm.weight"] = renamed.pop("model.norm.weight")
    (tmp_path / "renamed").mkdir()
    save_file(renamed, tmp_path / "renamed" / "model.safetensors")
    with pytest.raises(
        flatshard.CheckpointError,
        match=r"missing from the checkpoint: 'model.norm.weight'.*not in the model: 'model.final_norm.weight'",
    ):
        flatshard.load_pretrained(model, tmp_path / "renamed")
    # A shape mismatch, from a wider config.
    from .pretrained_common import llama_config

    wide = tmp_path / "wide"
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(llama_config(hidden=48)).save_pretrained(wide)
    with pytest.raises(flatshard.CheckpointError, match=r"is \[96, 48\].*is \[96, 32\].*Nothing was loaded"):
        flatshard.load_pretrained(model, wide)
    # A truncated file, an index naming a file that is not there.
    files = sorted(other.glob("model-*.safetensors"))
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) - 100])
    with pytest.raises(flatshard.CheckpointError, match=files[-1].name):
        flatshard.load_pretrained(model, other)
    files[-1].write_bytes(data)
    os.rename(files[0], tmp_path / "moved")
    with pytest.raises(flatshard.CheckpointError, match=files[0].name):
        flatshard.load_pretrained(model, other)
    after, _ = flatshard.get_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # strict=False loads what matches and reports the rest; what stayed unfilled is refused by name.
    os.rename(tmp_path / "moved", files[0])
    fresh = meta_model()
    flatshard.shard(fresh, auto_wrap_policy={BLOCK})
    result = flatshard.load_pretrained(fresh, tmp_path / "renamed", strict=False)
    assert result.missing == ["model.norm.weight"] and result.unexpected == ["model.final_norm.weight"]
    with pytest.raises(flatshard.UnfilledError, match=r"1 tensor\(s\).*'model.norm.weight'"):
        fresh(tokens())


def _failing_read(rank: int, world: int, root: str) -> dict[str, Any]:
    """A read that fails on one rank after the checks: every rank raises, and nothing of the load is used."""
    from flatshard.checkpoint import hf_source

    model = meta_model()
    flatshard.shard(model, auto_wrap_policy={BLOCK})
    original = hf_source.PretrainedSource.read

    def broken(self: Any, requests: Any) -> None:
        if rank == 1:
            raise OSError("Input/output error")
        original(self, requests)

    hf_source.PretrainedSource.read = broken  # type: ignore[method-assign]
    message = ""
    try:
        flatshard.load_pretrained(model, Path(root) / "multi")
    except flatshard.CheckpointError as err:
        message = str(err)
    finally:
        hf_source.PretrainedSource.read = original  # type: ignore[method-assign]
    try:
        model(tokens())
        refused = False
    except flatshard.UnfilledError:
        refused = True
    flatshard.load_pretrained(model, Path(root) / "multi")  # a later load that succeeds fills it
    with torch.no_grad():
        model(tokens())
    return {"message": message, "refused": refused}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_read_failing_on_one_rank_fails_every_rank(checkpoints: Path) -> None:
    for r in spawn(_failing_read, 2, str(checkpoints)):
        assert "Input/output error" in r["message"] and r["refused"], r


def _hybrid_and_offload(rank: int, world: int, root: str) -> dict[str, Any]:
    """Four ranks as two replicas of a 2-rank shard group, and CPU offload: each rank reads its shard's pieces
    (the replicas read the same ones)."""
    path = Path(root) / "multi"
    out: dict[str, Any] = {}
    for name, options in (
        ("hybrid", {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}),
        ("offload", {"cpu_offload": True}),
    ):
        model = meta_model()
        flatshard.shard(model, auto_wrap_policy={BLOCK}, **options)
        result = flatshard.load_pretrained(model, path)
        out[name] = _compare(model, path)
        out[name]["bytes_read"] = result.bytes_read
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybrid_sharding_and_offload_read_their_shards(checkpoints: Path) -> None:
    results = spawn(_hybrid_and_offload, 4, str(checkpoints))
    total = _data_bytes(checkpoints / "multi")
    for r in results:
        for case, v in r.items():
            assert v["state_equal"] and v["buffers_equal"] and v["logits"] < 1e-5, (case, v)
    hybrid = [r["hybrid"]["bytes_read"] for r in results]
    assert hybrid[0] + hybrid[1] == total and hybrid[0:2] == hybrid[2:4], hybrid
    assert sum(r["offload"]["bytes_read"] for r in results) == total
