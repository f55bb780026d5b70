"""What runs at the optimizer step on sharded state, without gathering it.

- ``clip``: the gradient norm over every rank's gradient shards, and clipping by it.
- ``ema``: an exponential moving average of the weights, kept as pieces of each rank's shard.
- ``whole_tensor``: optimizers that need each parameter whole (Muon), run on the parameter's owner rank;
  ``whole_plan`` (each such optimizer's parameters, owners and their states) and ``whole_exchange`` (its
  all-to-alls and the check before them) beside it.
- ``optimizer_offload``: ``cpu_offload="optimizer"``, the step in host memory on host copies of the shards
  (``host_shard``: a unit's host copies and the streams of their copies).
"""
