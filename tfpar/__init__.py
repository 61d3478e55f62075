"""tfpar: train Keras 3 transformer models in parallel on TensorFlow.

Example:
    >>> import tfpar, keras
    >>> strategy = tfpar.create_strategy("auto")
    >>> with strategy.scope():
    ...     model = keras.Sequential([...]); model.compile(...)
    >>> model.fit(dataset)
"""

from tfpar.errors import (
    ClusterConfigError,
    PeerUnreachableError,
    RuntimeAlreadyStartedError,
    StrategyOptionError,
    TfparError,
    TPUNotFoundError,
    UnknownStrategyError,
    UnsupportedStrategyError,
)
from tfpar.strategy import StrategyInfo, create_strategy, describe

__version__ = "0.1.0"

__all__ = [
    "ClusterConfigError", "PeerUnreachableError", "RuntimeAlreadyStartedError",
    "StrategyInfo", "StrategyOptionError", "TPUNotFoundError", "TfparError",
    "UnknownStrategyError", "UnsupportedStrategyError", "create_strategy", "describe",
]
