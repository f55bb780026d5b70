"""``flatshard consolidate SRC OUT.safetensors``: the model weights of a full checkpoint file, for inference
tools, and ``python -m flatshard``. No processes are spawned here; sharded directories written by a Trainer
are exported in ``tests/lightning/test_export.py``, a Hugging Face model in ``tests/hf/test_hf_export.py``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from flatshard.checkpoint import export as export_module
from flatshard.checkpoint import export_safetensors, load_safetensors
from flatshard.checkpoint.files import atomic_save
from flatshard.cli import main
from flatshard.testing.models import TinyGPT

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

EMA_KEY = "ShardedEMA{'decay': 0.9}"


def _lit_state(seed: int = 0) -> dict[str, Any]:
    """A LightningModule's state dict holding TinyGPT as ``self.model`` (head tied to the embedding)."""
    torch.manual_seed(seed)
    return {f"model.{k}": v for k, v in TinyGPT().state_dict().items()}


def _ckpt(path: Path, state: dict[str, Any] | None = None, **extra: Any) -> Path:
    atomic_save({"epoch": 0, "global_step": 3, "state_dict": state or _lit_state(), **extra}, path)
    return path


def _metadata(path: Path) -> dict[str, str]:
    with safetensors.safe_open(path, framework="pt") as f:
        return dict(f.metadata())


def test_full_file_exports_every_tensor_once_and_restores_ties(tmp_path: Path, capsys) -> None:
    state = _lit_state()
    state["model.t"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    state["model.blocks.0._extra_state"] = {"not": "a tensor"}
    src, out = _ckpt(tmp_path / "last.ckpt", state), tmp_path / "model.safetensors"
    assert main(["consolidate", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "blocks.0._extra_state" in printed and "left out" in printed
    assert "model.head.weight -> model.wte.weight" in printed

    plain = load_file(out)  # the safetensors package alone: the tied duplicate is absent
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert sorted(plain) == sorted(set(tensors) - {"model.head.weight"})
    for key, value in plain.items():
        assert value.dtype == tensors[key].dtype and torch.equal(value, tensors[key]), key
    metadata = _metadata(out)
    assert metadata["format"] == "pt" and metadata["flatshard.weights"] == "model"
    assert json.loads(metadata["flatshard.aliases"]) == {"model.head.weight": "model.wte.weight"}

    restored = load_safetensors(out)
    assert sorted(restored) == sorted(tensors)
    assert restored["model.head.weight"] is restored["model.wte.weight"]  # one tensor again
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "model.safetensors"]  # no temporary file left


def test_prefix_output_loads_strictly_into_the_inner_model(tmp_path: Path, capsys) -> None:
    src, out = _ckpt(tmp_path / "last.ckpt", _lit_state(seed=3)), tmp_path / "model.safetensors"
    assert main(["consolidate", str(src), str(out), "--prefix", "model."]) == 0
    model = TinyGPT()
    model.load_state_dict(load_safetensors(out), strict=True)
    assert model.head.weight is model.wte.weight
    for key, value in _lit_state(seed=3).items():
        assert torch.equal(model.state_dict()[key.removeprefix("model.")], value), key
    assert "head.weight" not in load_file(out)


def test_prefix_errors_name_the_prefixes_present(tmp_path: Path, capsys) -> None:
    state = {**_lit_state(), "ema.x": torch.zeros(2), "scale": torch.ones(())}
    src = _ckpt(tmp_path / "last.ckpt", state)
    out = tmp_path / "w.safetensors"
    assert main(["consolidate", str(src), str(out), "--prefix", "net."]) == 2
    err = capsys.readouterr().err
    assert "'net.'" in err and "['model.', 'ema.', 'scale']" in err, err
    assert main(["consolidate", str(src), str(out), "--prefix", "model"]) == 2
    assert "HINT: end the prefix with '.', e.g. 'model.'" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_suffix_and_ckpt_with_weight_options_are_refused(tmp_path: Path, capsys) -> None:
    src = _ckpt(tmp_path / "last.ckpt")
    for name in ("model.pt", "model", "model.bin"):
        assert main(["consolidate", str(src), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert "unknown output format" in err and ".ckpt" in err and ".safetensors" in err, err
    assert main(["consolidate", str(src), str(tmp_path / "full.ckpt"), "--prefix", "model."]) == 2
    assert "name the output OUT.safetensors" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_existing_output_is_replaced_atomically_a_directory_refused(tmp_path: Path, capsys) -> None:
    src, out = _ckpt(tmp_path / "last.ckpt"), tmp_path / "model.safetensors"
    out.write_bytes(b"old")
    os.chmod(out, 0o640)
    assert main(["consolidate", str(src), str(out)]) == 0  # like a .ckpt OUT: replaced
    assert sorted(load_file(out)) and (out.stat().st_mode & 0o777) == 0o640
    taken = tmp_path / "dir.safetensors"
    taken.mkdir()
    capsys.readouterr()
    assert main(["consolidate", str(src), str(taken)]) == 2
    assert "a directory of that name exists" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["dir.safetensors", "last.ckpt", "model.safetensors"]


def test_ema_weights_replace_the_trained_ones(tmp_path: Path, capsys) -> None:
    state = _lit_state(seed=0)
    torch.manual_seed(1)
    # as an EMA over named_parameters() keeps them: the tied head is not a name of its own, buffers are absent
    ema = {f"model.{n}": p.detach().clone() for n, p in TinyGPT().named_parameters()}
    src = _ckpt(tmp_path / "last.ckpt", state, callbacks={EMA_KEY: {"ema_state_dict": ema, "decay": 0.9}})
    out = tmp_path / "ema.safetensors"
    assert main(["consolidate", str(src), str(out), "--ema", "--prefix", "model."]) == 0
    printed = capsys.readouterr().out
    assert "EMA weights" in printed and "keep the checkpoint's values" in printed and "model.steps" in printed
    restored = load_safetensors(out)
    for key, value in ema.items():
        assert torch.equal(restored[key.removeprefix("model.")], value), key
    assert restored["head.weight"] is restored["wte.weight"]  # the EMA embedding, still tied
    assert torch.equal(restored["steps"], state["model.steps"])
    assert _metadata(out)["flatshard.weights"] == "ema"
    TinyGPT().load_state_dict(restored, strict=True)


def test_ema_errors(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ema.safetensors"
    plain = _ckpt(tmp_path / "plain.ckpt", callbacks={"ModelCheckpoint": {"best": None}})
    assert main(["consolidate", str(plain), str(out), "--ema"]) == 2
    assert (
        "this checkpoint holds no EMA weights; train with flatshard.lightning.ShardedEMA"
        in capsys.readouterr().err
    )
    ema = {k: v.clone() for k, v in _lit_state(seed=1).items()}
    two = _ckpt(
        tmp_path / "two.ckpt",
        callbacks={EMA_KEY: {"ema_state_dict": ema}, "ShardedEMA{'decay': 0.99}": {"ema_state_dict": {}}},
    )
    assert main(["consolidate", str(two), str(out), "--ema"]) == 2
    assert "several EMA states" in capsys.readouterr().err
    assert main(["consolidate", str(two), str(out), "--ema-key", EMA_KEY]) == 0
    assert torch.equal(load_file(out)["model.wte.weight"], ema["model.wte.weight"])
    wrong = _ckpt(
        tmp_path / "wrong.ckpt", callbacks={EMA_KEY: {"ema_state_dict": {"wte.weight": torch.ones(1)}}}
    )
    assert main(["consolidate", str(wrong), str(out), "--ema"]) == 2
    assert "keyed by the model's state-dict names" in capsys.readouterr().err
    piece = {"model.wte.weight": torch.zeros(5)}  # a rank's piece, not the full tensor
    pieces = _ckpt(tmp_path / "pieces.ckpt", callbacks={EMA_KEY: {"ema_state_dict": piece}})
    assert main(["consolidate", str(pieces), str(out), "--ema"]) == 2
    assert "the EMA weight 'model.wte.weight' has shape (5,)" in capsys.readouterr().err


def test_dtypes_shapes_and_overlapping_views(tmp_path: Path) -> None:
    base = torch.randn(6, 4)
    state = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(2).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(5),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "empty2": torch.empty(0),
        "top": base[:3],  # views sharing one storage without being one tensor: two copies
        "bottom": base[3:],
        "strided": base[:, ::2],
    }
    src, out = _ckpt(tmp_path / "x.ckpt", state), tmp_path / "x.safetensors"
    result = export_safetensors(src, out)
    assert result.aliases == {} and result.tensors == len(state)
    plain = load_file(out)
    for key, value in state.items():
        got = plain[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, value)]
        assert torch.equal(*as_bytes), key
    bad = _ckpt(tmp_path / "bad.ckpt", {"c": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(ValueError, match=r"'c' has dtype torch.complex128, which safetensors cannot store"):
        export_safetensors(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    src = _ckpt(tmp_path / "last.ckpt")
    monkeypatch.setattr(export_module, "PROGRESS_MIN_BYTES", 0)
    assert main(["consolidate", str(src), str(tmp_path / "a.safetensors")]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["consolidate", str(src), str(tmp_path / "b.safetensors")]) == 0
    assert "b.safetensors" in terminal.getvalue() and "100%" in terminal.getvalue(), terminal.getvalue()
    monkeypatch.setattr(export_module, "PROGRESS_MIN_BYTES", 2**40)  # a small export shows none
    small = _Terminal()
    monkeypatch.setattr(sys, "stderr", small)
    assert main(["consolidate", str(src), str(tmp_path / "c.safetensors")]) == 0
    assert small.getvalue() == ""


def test_export_to_and_load_from_a_url(tmp_path: Path) -> None:
    src = _ckpt(tmp_path / "last.ckpt")
    url = f"memory://flatshard-export-{uuid.uuid4().hex[:8]}/run/model.safetensors"
    assert export_safetensors(src, url, prefix="model.").path == url
    restored = load_safetensors(url)
    TinyGPT().load_state_dict(restored, strict=True)
    assert restored["head.weight"] is restored["wte.weight"]


@pytest.mark.slow
def test_python_dash_m_flatshard_is_the_console_script(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)

    as_module, as_script = run("-m", "flatshard", "--help"), run("-m", "flatshard.cli", "--help")
    assert as_module.returncode == 0 and "consolidate" in as_module.stdout
    assert as_module.stdout == as_script.stdout
    src, out = _ckpt(tmp_path / "last.ckpt"), tmp_path / "model.safetensors"
    done = run("-m", "flatshard", "consolidate", str(src), str(out), "--prefix", "model.")
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and done.stderr == ""  # not a terminal: no progress bar
    TinyGPT().load_state_dict(load_safetensors(out), strict=True)
    refused = run("-m", "flatshard", "consolidate", str(src), str(tmp_path / "model.onnx"))
    assert refused.returncode == 2 and "unknown output format '.onnx'" in refused.stderr
