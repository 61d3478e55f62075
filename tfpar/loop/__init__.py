"""tfpar's own training loop: the Trainer, and (re-exported) the gradient-aggregation seam.

The aggregation contract lives below the loop, in `tfpar.aggregation`, where the loop,
compression and ZeRO all look down to it. Names load on first use.
"""

import importlib

_NAMES = {
    "AllReduce": "tfpar.aggregation",
    "GradientAggregator": "tfpar.aggregation",
    "NoReduce": "tfpar.aggregation",
    "Trainer": "tfpar.loop.trainer",
    "TrainerError": "tfpar.loop.trainer",
}

__all__ = list(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'tfpar.loop' has no attribute {name!r}")
