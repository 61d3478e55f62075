"""tfpar's own training loop: Trainer and the gradient-aggregation seam."""

from tfpar.loop.aggregation import AllReduce, GradientAggregator, NoReduce
from tfpar.loop.trainer import Trainer, TrainerError

__all__ = ["AllReduce", "GradientAggregator", "NoReduce", "Trainer", "TrainerError"]
