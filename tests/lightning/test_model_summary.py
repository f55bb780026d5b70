"""``ModelSummary`` / ``RichModelSummary`` under flatshard show the model's parameter counts (what one unsharded
process shows), not each rank's shards; with ``example_input_array`` too (its forward gathers as usual)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import summarize

from flatshard.testing import spawn

from .lit_common import LitGPT, make_loader, make_trainer

pytestmark = pytest.mark.slow

_SEEN: list[dict[str, Any]] = []


def _record(summary_data: Any, total: int, trainable: int, size: float, *args: Any, **kwargs: Any) -> None:
    _SEEN.append({"data": summary_data, "total": total, "trainable": trainable, "size": round(size, 6)})


class _RecordingSummary(ModelSummary):
    summarize = staticmethod(_record)  # type: ignore[assignment]


class _RecordingRichSummary(RichModelSummary):
    summarize = staticmethod(_record)  # type: ignore[assignment]


class _WithExample(LitGPT):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.example_input_array = torch.zeros(2, 5, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def _expected(example: bool) -> dict[str, Any]:
    module = _WithExample() if example else LitGPT()
    summary = summarize(module, max_depth=2)
    data = summary._get_summary_data()
    return {
        "data": data,
        "total": summary.total_parameters,
        "trainable": summary.trainable_parameters,
        "size": round(summary.model_size, 6),
    }


def _fit(rank: int, world: int, rich: bool, example: bool, strategy: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    _SEEN.clear()
    callback = _RecordingRichSummary(max_depth=2) if rich else _RecordingSummary(max_depth=2)
    trainer = make_trainer(world, strategy, callbacks=[callback], enable_model_summary=True, max_steps=1)
    model = _WithExample() if example else LitGPT()
    trainer.fit(model, make_loader(1, 4, world))
    return list(_SEEN)


@pytest.mark.parametrize(
    ("rich", "example", "strategy"),
    [(False, False, "flatshard"), (True, True, "flatshard"), (False, True, "flatshard_grad_op")],
    ids=["summary", "rich_with_example_input", "grad_op_with_example_input"],
)
def test_summary_counts_the_full_model(rich: bool, example: bool, strategy: str) -> None:
    if rich:
        pytest.importorskip("rich")
    expected = _expected(example)
    for rank, seen in enumerate(spawn(_fit, 2, rich, example, strategy)):
        assert len(seen) == (rank == 0), (rank, seen)  # Lightning prints the summary on rank 0
        if not seen:
            continue
        got = seen[0]
        assert got["total"] == expected["total"] and got["trainable"] == expected["trainable"], (rank, got)
        assert got["size"] == expected["size"], (rank, got["size"], expected["size"])
        assert got["data"] == expected["data"], (rank, got["data"], expected["data"])
