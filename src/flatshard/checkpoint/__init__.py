"""Checkpoint files and directories for sharded modules: save, load (any world size), consolidate.

Two formats, told apart by what is on disk:

- **full**: one ``torch.save`` file, a plain Lightning checkpoint (``state_dict``, ``optimizer_states`` in
  the plain optimizers' format, plus whatever else the checkpoint dict holds). Written by rank 0.
- **sharded**: a ``torch.distributed.checkpoint`` directory, written by every rank without tensor
  communication (see ``flatshard/checkpoint/directory.py`` and ``write_sharded.py``).

Both load into a sharded module on any world size and wrap policy, and both are validated completely
(keys, shapes, optimizer groups, truncated or missing files, format version) before anything changes.
Both live at a local path or any fsspec URL (``s3://``, ``gs://``, ...): see ``flatshard/checkpoint/storage.py``.

This module is the package's contract: the rest of flatshard (the strategies, the command line) imports only
the names in ``__all__`` below, never a module inside, as ``flatshard.engine`` is the engine's
(``tests/unit/test_layout.py`` holds both to it).
"""

from flatshard.checkpoint.async_save import AsyncSaver
from flatshard.checkpoint.consolidate import consolidate
from flatshard.checkpoint.dcp_layout import Names
from flatshard.checkpoint.directory import ShardedReader, is_sharded_checkpoint
from flatshard.checkpoint.errors import CheckpointError
from flatshard.checkpoint.export import export_safetensors, load_safetensors, output_format
from flatshard.checkpoint.export_pretrained import PretrainedExport, export_pretrained
from flatshard.checkpoint.files import atomic_save, load_checkpoint_file, write_full_checkpoint
from flatshard.checkpoint.hf_export import parse_dtype, parse_max_shard_size
from flatshard.checkpoint.load import load_checkpoint, load_full_entries, load_into
from flatshard.checkpoint.pretrained import PretrainedLoad, load_pretrained
from flatshard.checkpoint.save import StateDictType, save_checkpoint
from flatshard.checkpoint.save_pretrained import save_pretrained
from flatshard.checkpoint.save_round import gather_for_save
from flatshard.checkpoint.storage import is_url, locate, remove_checkpoint, size_of
from flatshard.checkpoint.stream_save import ModelState, OptimizerState, save_full_streamed
from flatshard.checkpoint.validate import check_optim_state_kinds, check_required, check_state_dict_kinds
from flatshard.checkpoint.write_sharded import write_sharded_checkpoint

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "ModelState",
    "Names",
    "OptimizerState",
    "PretrainedExport",
    "PretrainedLoad",
    "ShardedReader",
    "StateDictType",
    "atomic_save",
    "check_optim_state_kinds",
    "check_required",
    "check_state_dict_kinds",
    "consolidate",
    "export_pretrained",
    "export_safetensors",
    "gather_for_save",
    "is_sharded_checkpoint",
    "is_url",
    "load_checkpoint",
    "load_checkpoint_file",
    "load_full_entries",
    "load_into",
    "load_pretrained",
    "load_safetensors",
    "locate",
    "output_format",
    "parse_dtype",
    "parse_max_shard_size",
    "remove_checkpoint",
    "save_checkpoint",
    "save_full_streamed",
    "save_pretrained",
    "size_of",
    "write_full_checkpoint",
    "write_sharded_checkpoint",
]
