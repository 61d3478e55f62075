"""Strategy factory: one name -> a tf.distribute strategy, cluster found and checked."""

from tfpar.strategy.describe import StrategyInfo, describe, strategy_kind
from tfpar.strategy.factory import (ALIASES, STRATEGY_NAMES, create_strategy, normalize_name,
                                    partitioner)

__all__ = [
    "ALIASES", "STRATEGY_NAMES", "StrategyInfo", "create_strategy", "describe",
    "normalize_name", "partitioner", "strategy_kind",
]
