"""Shared pieces of the Hugging Face tier: tiny random configs, a LightningModule around an HF model,
deterministic data, and the comparisons.

Every model is built from a config (no download), dropout-free, and seeded in the LightningModule's
constructor, so every rank and every strategy starts from the same weights. Data: the same
``TensorDataset`` on every run; Lightning's ``DistributedSampler`` (``seed = PL_GLOBAL_SEED or 0``) splits
it the same way for ``ddp`` and ``flatshard`` on the same world size, so both see the same global batch at
every step (see ``tests/lightning/lit_common.py`` for the layout).

Functions that run inside ``flatshard.testing.spawn`` are module-level (here: ``train_cases``, the runs
``conftest.trained`` shares between the parity and checkpoint tests; the others in their test modules); the
spawned ranks import them as ``tests.hf.<module>`` (they inherit pytest's ``sys.path``).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.t5.modeling_t5 import T5Block

from tests.lightning.lit_common import LossRecorder, make_trainer

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

MODEL_PREFIX = "model."  # LitHF keeps the HF model as ``self.model``
WEIGHT_TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB = 64
SEQ = 12  # GPT-2 sequence length, T5 source length
TARGET = 6  # T5 target length
IMAGE = 16  # ResNet images: 3 x 16 x 16
LABELS = 3

# The unit class of each model for ``auto_wrap_policy`` (block units).
BLOCKS: dict[str, type[torch.nn.Module]] = {"gpt2": GPT2Block, "t5": T5Block}


def build_config(kind: str) -> Any:
    if kind == "gpt2":
        return GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
            pad_token_id=0,
        )
    if kind == "t5":
        return T5Config(
            d_model=32,
            d_ff=64,
            d_kv=16,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            vocab_size=VOCAB,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            classifier_dropout=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    if kind == "llama":
        return llama_config()
    if kind == "resnet":
        return ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=LABELS,
        )
    raise ValueError(kind)


def llama_config(layers: int = 2, heads: int = 2, kv_heads: int = 2) -> LlamaConfig:
    """The tiny Llama's config: hidden size 32, ``heads`` attention heads over ``kv_heads`` key-value heads."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_llama(seed: int = 0) -> tuple[LlamaForCausalLM, type[torch.nn.Module]]:
    """A tiny random Llama with three decoder layers and grouped-query attention (4 heads over 2 key-value
    heads), the same for a given seed on every rank; and its decoder layer class, the unit for
    ``auto_wrap_policy``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(layers=3, heads=4, kv_heads=2)), LlamaDecoderLayer


def build_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random HF model, the same for a given seed on every rank."""
    torch.manual_seed(seed)
    cls = {
        "gpt2": GPT2LMHeadModel,
        "t5": T5ForConditionalGeneration,
        "llama": LlamaForCausalLM,
        "resnet": ResNetForImageClassification,
    }[kind]
    return cls(build_config(kind))


def make_dataset(kind: str, steps: int, global_batch: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    n = steps * global_batch
    if kind == "gpt2":
        return TensorDataset(torch.randint(1, VOCAB - 1, (n, SEQ), generator=g))
    if kind == "t5":
        return TensorDataset(
            torch.randint(2, VOCAB, (n, SEQ), generator=g), torch.randint(2, VOCAB, (n, TARGET), generator=g)
        )
    if kind == "resnet":
        return TensorDataset(
            torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, LABELS, (n,), generator=g)
        )
    raise ValueError(kind)


def make_loader(kind: str, steps: int, global_batch: int, world: int) -> DataLoader:
    """Per-rank loader: ``global_batch / world`` samples per rank; Lightning adds its DistributedSampler."""
    assert global_batch % world == 0, (global_batch, world)
    return DataLoader(
        make_dataset(kind, steps, global_batch), batch_size=global_batch // world, shuffle=False
    )


def model_loss(kind: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if kind == "gpt2":
        return model(input_ids=batch[0], labels=batch[0]).loss
    if kind == "t5":
        return model(input_ids=batch[0], labels=batch[1]).loss
    return model(pixel_values=batch[0], labels=batch[1]).loss


class LitHF(L.LightningModule):
    """An HF model as ``self.model``, trained on its own loss (``labels=`` argument)."""

    def __init__(self, kind: str, optimizer: str = "adamw", lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.model = build_model(kind, seed)
        self.optimizer_name = optimizer
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = model_loss(self.kind, self.model, batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = model_loss(self.kind, self.model, batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        raise ValueError(self.optimizer_name)


def strategy_for(kind: str, name: str) -> Any:
    """``"ddp"``, ``"flatshard"`` (one root unit) or ``"flatshard_block"`` (one unit per transformer block)."""
    import flatshard

    if name == "flatshard_block":
        return flatshard.FlatShardStrategy(auto_wrap_policy={BLOCKS[kind]})
    return {"ddp": "ddp", "flatshard": "flatshard"}[name]


def hf_state_dict(checkpoint_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A Lightning checkpoint's ``state_dict`` with the LightningModule attribute prefix stripped."""
    assert all(k.startswith(MODEL_PREFIX) for k in checkpoint_state), sorted(checkpoint_state)
    return {k[len(MODEL_PREFIX) :]: v for k, v in checkpoint_state.items()}


def tied_keys(model: PreTrainedModel) -> dict[str, str]:
    """``{tied key: source key}`` as the model declares it (transformers 5: ``_tied_weights_keys``)."""
    declared = getattr(model, "_tied_weights_keys", None) or {}
    assert isinstance(declared, dict), type(declared)
    return dict(declared) if getattr(model.config, "tie_word_embeddings", True) else {}


def tie_missing_keys(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a user does before a strict load of a state dict written without the tied duplicates (as
    ``save_pretrained`` writes them): fill each absent tied key from its source. Keys already present are
    left alone."""
    state = dict(state)
    for key, source in tied_keys(model).items():
        if key not in state and source in state:
            state[key] = state[source]
    return state


def assert_ties(kind: str, model: PreTrainedModel) -> None:
    """The tied parameters are one Parameter object."""
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    elif kind == "t5":
        shared = model.shared.weight
        assert model.encoder.embed_tokens.weight is shared
        assert model.decoder.embed_tokens.weight is shared
        assert model.lm_head.weight is shared


def prompt(kind: str) -> dict[str, torch.Tensor]:
    """A fixed two-sequence prompt for ``generate``."""
    g = torch.Generator().manual_seed(7)
    low = 1 if kind == "gpt2" else 2
    ids = torch.randint(low, VOCAB - 1, (2, 5), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(kind: str, model: Any) -> dict[str, Any]:
    """Greedy decoding of the fixed prompt: the tokens (compared exactly) and the logits of every decoding
    step (compared to ``WEIGHT_TOL``: tiny random models often repeat one token, so the tokens alone would
    not notice wrong weights)."""
    out = model.generate(
        **prompt(kind),
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits).detach()}


def assert_same_generation(actual: dict[str, Any], expected: dict[str, Any], what: Any) -> None:
    assert actual["tokens"] == expected["tokens"], (what, actual["tokens"], expected["tokens"])
    torch.testing.assert_close(
        actual["logits"], expected["logits"], **WEIGHT_TOL, msg=lambda m: f"{what}: {m}"
    )


# The training runs the parity and checkpoint tests share: (model, strategy) pairs, run in one spawn.
TRAIN_STEPS = 3
GLOBAL_BATCH = 8
TRAIN_CASES: list[tuple[str, str]] = [
    ("gpt2", "ddp"),
    ("gpt2", "flatshard"),
    ("gpt2", "flatshard_block"),
    ("t5", "ddp"),
    ("t5", "flatshard"),
    ("t5", "flatshard_block"),
    ("resnet", "ddp"),
    ("resnet", "flatshard"),
]
OPTIMIZER = {"gpt2": "adamw", "t5": "adamw", "resnet": "sgd"}


def checkpoint_name(kind: str, strategy: str) -> str:
    return f"{kind}-{strategy}.ckpt"


def train_cases(rank: int, world: int, out_dir: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Fit every ``(model, strategy)`` case in turn on these ranks; each run saves its consolidated checkpoint
    with ``trainer.save_checkpoint`` under ``out_dir``. Returns this rank's per-step synced losses."""
    import os

    torch.set_num_threads(1)
    losses: dict[str, list[float]] = {}
    for kind, strategy in cases:
        module = LitHF(kind, optimizer=OPTIMIZER[kind], lr=1e-2 if OPTIMIZER[kind] == "adamw" else 0.1)
        recorder = LossRecorder()
        trainer = make_trainer(world, strategy_for(kind, strategy), max_epochs=1, callbacks=[recorder])
        trainer.fit(module, make_loader(kind, TRAIN_STEPS, GLOBAL_BATCH, world))
        assert trainer.global_step == TRAIN_STEPS, trainer.global_step
        trainer.save_checkpoint(os.path.join(out_dir, checkpoint_name(kind, strategy)))
        assert_ties(kind, module.model)  # still one Parameter after sharding, training and saving
        losses[f"{kind}-{strategy}"] = recorder.losses
    return losses
