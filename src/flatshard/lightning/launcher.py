"""The ``start_method="spawn"`` launcher: Lightning's, but it sends rank 0's *full* weights home.

Lightning's multiprocessing launcher returns ``lightning_module.state_dict()`` from rank 0 to the main
process. Under flatshard that holds only rank 0's pieces of each parameter, which neither match nor fit
the main process's unsharded module. This launcher gathers the full state on all ranks first (a
collective, like every state gather) and returns that.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SpawnLauncher"]


class SpawnLauncher(_MultiProcessingLauncher):
    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        full_state = trainer.strategy.lightning_module_state_dict()  # every rank joins; rank 0 keeps it
        if self._strategy.global_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(full_state, weights_path)
        return _WorkerOutput(
            best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer)
        )
