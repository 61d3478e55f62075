"""tfpar: train Keras 3 transformer models in parallel on TensorFlow.

Example:
    >>> import tfpar, keras
    >>> strategy = tfpar.create_strategy("auto")
    >>> with strategy.scope():
    ...     model = keras.Sequential([...]); model.compile(...)
    >>> model.fit(dataset)

`import tfpar` is light: TensorFlow loads on first use of what needs it, so
`tfpar-launch` starts in a blink and nothing touches TensorFlow's runtime early.
"""

import importlib

from tfpar.errors import (
    ClusterConfigError,
    KerasBackendError,
    PeerUnreachableError,
    RuntimeAlreadyStartedError,
    StrategyOptionError,
    TfparError,
    TPUNotFoundError,
    TPUSliceError,
    UnknownStrategyError,
    UnsupportedStrategyError,
)

__version__ = "0.1.0"

_LAZY = {
    "create_strategy": "tfpar.strategy",
    "describe": "tfpar.strategy",
    "StrategyInfo": "tfpar.strategy",
    "Trainer": "tfpar.loop",
}

__all__ = [
    "ClusterConfigError", "KerasBackendError", "PeerUnreachableError", "RuntimeAlreadyStartedError",
    "StrategyOptionError", "TPUNotFoundError", "TPUSliceError", "TfparError",
    "UnknownStrategyError", "UnsupportedStrategyError", *_LAZY,
]


_SUBPACKAGES = ("compression", "controller", "data", "distribution", "evaluation", "launch", "loop", "models",
                "placement", "recipes", "strategy", "sync", "tensor_parallel", "zero")


def __getattr__(name):
    if name in _SUBPACKAGES:  # `tfpar.data.load(...)` after a plain `import tfpar`
        return importlib.import_module(f"tfpar.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfpar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
