"""``load_pretrained`` on Hugging Face architectures beyond Llama, each a tiny random model saved by transformers'
own ``save_pretrained`` (several files): GPT-2 (``Conv1D``, tied head), Qwen2 (biases), Gemma 2, OPT (learned
positions), GPT-NeoX (its head stored as ``embed_out``: a renaming), Mixtral and Qwen2-MoE (one checkpoint tensor
per expert, one 3-D parameter in the model: converters, see [Note: transformers' weight conversions]), T5
(encoder-decoder) and BERT (masked LM). On 2 ranks, sharded by decoder layer from the meta device, every
parameter and buffer and the logits must equal ``from_pretrained``'s exactly. Written back with
``flatshard.save_pretrained``, each holds the tensors transformers' own ``save_pretrained`` wrote, under the same
names (the experts one per tensor again), bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flatshard.testing import spawn

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

VOCAB = 96
_SMALL = {"vocab_size": VOCAB, "max_position_embeddings": 64}
_DECODER = {
    **_SMALL,
    "hidden_size": 32,
    "intermediate_size": 72,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _configs() -> dict[str, Any]:
    t = transformers
    return {
        "gpt2": t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "qwen2": t.Qwen2Config(**_DECODER),
        "gemma2": t.Gemma2Config(**_DECODER, head_dim=8),
        "opt": t.OPTConfig(
            **_SMALL,
            hidden_size=32,
            ffn_dim=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        ),
        "gpt_neox": t.GPTNeoXConfig(
            **_SMALL, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4
        ),
        "mixtral": t.MixtralConfig(
            **{**_DECODER, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": t.Qwen2MoeConfig(
            **_DECODER,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "t5": t.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        ),
        "bert": t.BertConfig(
            **_SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        ),
    }


def _auto(name: str) -> Any:
    return {"t5": transformers.AutoModelForSeq2SeqLM, "bert": transformers.AutoModelForMaskedLM}.get(
        name, transformers.AutoModelForCausalLM
    )


def _logits(model: Any, name: str, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if name == "t5":
            return model(input_ids=x, decoder_input_ids=x).logits
        return model(input_ids=x).logits


def _blocks(model: Any) -> set[type]:
    """The repeated layer classes transformers itself shards by (``_no_split_modules``)."""
    wanted = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in wanted}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _load(rank: int, world: int, root: str, names: list[str]) -> dict[str, Any]:
    import flatshard

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for name in names:
        path = Path(root) / name
        ref = _auto(name).from_pretrained(path, dtype=torch.float32).eval()
        with torch.device("meta"):
            model = _auto(name).from_config(
                transformers.AutoConfig.from_pretrained(path), dtype=torch.float32
            )
        model.eval()
        blocks = _blocks(model)
        flatshard.shard(model, auto_wrap_policy=blocks)
        result = flatshard.load_pretrained(model, path)
        diff = float((_logits(model, name, x) - _logits(ref, name, x)).abs().max())
        with flatshard.unshard_params(model):
            want = ref.state_dict()
            got = model.state_dict()
            unequal = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
        exported = Path(root) / "exports" / name
        flatshard.save_pretrained(model, exported)
        out[name] = {
            "diff": diff,
            "unequal": unequal,
            "units": len(blocks),
            "converted": any("conversions" in n for n in result.notes),
        }
    return out


@pytest.mark.timeout(600)
def test_architectures_load_as_from_pretrained_does(tmp_path: Path) -> None:
    configs = _configs()
    for name, config in configs.items():
        torch.manual_seed(0)
        model = _auto(name).from_config(config)
        with torch.no_grad():  # norms away from their init value, so one left unloaded shows
            for key, p in model.named_parameters():
                if "norm" in key.lower() or ".ln" in key:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp_path / name, max_shard_size="20KB")
    moe_file = next((tmp_path / "mixtral").glob("*.safetensors"))
    assert moe_file.exists()
    for rank, result in enumerate(spawn(_load, 2, str(tmp_path), list(configs))):
        for name, r in result.items():
            assert r["units"] > 0, (name, "no layer class to shard by")
            assert r["diff"] == 0.0 and r["unequal"] == [], (rank, name, r)
            assert r["converted"] == (name in ("mixtral", "qwen2_moe")), (rank, name, r)
    for name in configs:
        written, want = _tensors(tmp_path / "exports" / name), _tensors(tmp_path / name)
        assert sorted(written) == sorted(want), (name, sorted(set(written) ^ set(want))[:6])
        assert all(torch.equal(written[k], want[k]) for k in want), name
