"""``flatshard estimate`` and ``flatshard.estimate()``: per-rank memory and step communication of sharded training on N ranks, measured on
the meta device through the engine itself (see [Note: estimating a step] in ``flatshard.estimator.api``)."""

from flatshard.estimator.api import Estimate, RankEstimate, estimate
from flatshard.estimator.options import LINKS, EstimateOptions, Link
from flatshard.estimator.report import format_bytes, format_table
from flatshard.estimator.target import EstimateError, training_step
from flatshard.estimator.tracker import StorageTracker

__all__ = [
    "LINKS",
    "Estimate",
    "EstimateError",
    "EstimateOptions",
    "Link",
    "RankEstimate",
    "StorageTracker",
    "estimate",
    "format_bytes",
    "format_table",
    "training_step",
]
