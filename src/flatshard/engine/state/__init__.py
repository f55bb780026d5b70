"""Model and optimizer state of a sharded module: full (gathered, original names and shapes) and sharded
(each rank's pieces), and the unsharded view of the parameters.

- ``state_dict``: :func:`get_state_dict` / :func:`set_state_dict`, the user-facing pair.
- ``full_model``: the full model state dict (gather to rank 0, validate, load slice by slice).
- ``full_entries``: what a full model state dict will hold (names, dtypes, shapes, ties, arrival order), before
  anything is gathered: for writers that lay out files ahead of the data.
- ``full_optim``: the full optimizer state in the plain optimizer's format, both ways.
- ``optim_binding``: pointing optimizers at sharded parameters (by name), shapes for ``configure_optimizers``.
- ``sharded``: each rank's pieces (:class:`ParamShard`) for sharded checkpoints, and loading them back.
- ``stand_ins``: where saved state reads a parameter (its shard's piece, or the EMA's shadow while swapped in).
- ``stream_gather``: the chunked gather to rank 0 behind every full state dict.
- ``unshard_params``: the context manager that shows full parameters (all ranks or rank 0 alone).
- ``whole_state``: a whole-tensor optimizer's state (whole on each parameter's owner) in pieces for saves, whole
  again after loads.
"""
