"""flatshard's benchmark suite: ``python -m benchmarks SCENARIO ...`` (see ``benchmarks/README.md``).

``model`` (the GPT and its presets), ``contenders`` (the one registry of flatshard and its peers), ``measure``
(what the ranks read), ``schema`` (the one JSON report), ``report`` (tables, ratios, plots, files) and
``scenarios/`` (one module per scenario). ``gpu_check.py`` is a command of its own.
"""
