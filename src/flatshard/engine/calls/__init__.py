"""Calling a sharded model beyond one forward of its root: what the hooks in ``runtime`` need to be told.

- ``forward_methods``: methods other than ``forward`` (``generate``) that gather like it.
- ``compile``: ``torch.compile`` of the units, with the hooks outside the compiled graphs.
- ``join``: evaluation loops with uneven batch counts, completed by ranks that ran out of data.
"""
