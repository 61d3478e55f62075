"""What must happen before TensorFlow's runtime starts: device splits and collectives.

TensorFlow fixes its devices and its collective configuration the first time anything
touches the runtime (a tensor, a device listing of logical devices, a model). These
helpers say, early and plainly, when that moment has already passed.

Example:
    >>> split_devices(4)               # before any TensorFlow op
    ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.eager import context

from tfpar.errors import RuntimeAlreadyStartedError, StrategyOptionError


def runtime_started() -> bool:
    """True once TensorFlow's eager context exists (devices and collectives are fixed)."""
    return context.context()._context_handle is not None  # pylint: disable=protected-access


def ensure_not_started(what: str) -> None:
    """Raises RuntimeAlreadyStartedError if TensorFlow has already started."""
    if runtime_started():
        raise RuntimeAlreadyStartedError(
            f"{what} must be set up before TensorFlow starts, but TensorFlow already ran an op "
            "(a tensor, a model, a device listing). Call tfpar.create_strategy(...) first thing "
            "in your program, before building models or data, or restart the Python process "
            "(in a notebook: restart the runtime)."
        )


def split_devices(count: int, gpu_memory_mb: int = 1024) -> list[str]:
    """Splits each GPU (or, without GPUs, the CPU) into `count` logical devices.

    Returns the logical device names ("/device:CPU:0", ...; full names once TensorFlow has
    started), without starting TensorFlow: `create_strategy("multi_worker_mirrored",
    virtual_devices=2)` can follow. Idempotent: asking again for the split that is already
    in place is fine even after TensorFlow has started.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise StrategyOptionError(
            f"virtual_devices must be a positive integer, got {count!r}."
        )
    gpus = tf.config.list_physical_devices("GPU")
    physical = gpus or tf.config.list_physical_devices("CPU")[:1]
    kind = "GPU" if gpus else "CPU"
    for device in physical:
        current = tf.config.get_logical_device_configuration(device)
        if current is not None and len(current) == count:
            continue
        if current is None and count == 1:
            continue
        ensure_not_started(f"virtual_devices={count}")
        if kind == "GPU":
            config = [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)] * count
        else:
            config = [tf.config.LogicalDeviceConfiguration()] * count
        tf.config.set_logical_device_configuration(device, config)
    if not runtime_started():  # listing would start TensorFlow, and a multi-worker strategy
        return [f"/device:{kind}:{i}" for i in range(count * len(physical))]  # must come first
    return [device.name for device in tf.config.list_logical_devices(kind)]


def local_compute_devices() -> list[str]:
    """Logical GPUs if there are any, else logical CPUs."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
