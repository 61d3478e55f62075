"""tfpar's own training loop: Trainer and the gradient-aggregation seam."""

from tfpar.loop.aggregation import AllReduce, GradientAggregator
from tfpar.loop.trainer import Trainer, TrainerError

__all__ = ["AllReduce", "GradientAggregator", "Trainer", "TrainerError"]
