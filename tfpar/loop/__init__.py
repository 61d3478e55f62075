"""tfpar's own training loop: Trainer and the gradient-aggregation seam.

Names load on first use, so `tfpar.compression` can build on the aggregation contract
(`tfpar.loop.aggregation`) without importing the Trainer, which imports compression.
"""

import importlib

_NAMES = {
    "AllReduce": "tfpar.loop.aggregation",
    "GradientAggregator": "tfpar.loop.aggregation",
    "NoReduce": "tfpar.loop.aggregation",
    "Trainer": "tfpar.loop.trainer",
    "TrainerError": "tfpar.loop.trainer",
}

__all__ = list(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'tfpar.loop' has no attribute {name!r}")
