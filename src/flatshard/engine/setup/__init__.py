"""What ``shard()`` does once, before any step: the units and what they are made of.

- ``wrap``: unit planning from ``auto_wrap_policy`` (which modules become units, which unit owns a shared
  parameter) and the aliases of each parameter.
- ``materialize``: a model built on the meta device, materialized one unit at a time.
- ``process_groups``: the shard and replicate groups of the hybrid strategies.
- ``activation_checkpointing``: which submodules recompute their activations in backward.
"""
