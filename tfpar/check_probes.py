"""What tfpar-check measures: all-reduce latency and bus bandwidth, matmul throughput per
device (TF32 on and off where it applies), and one GPT step in Keras fit and tfpar's loop.

Example:
    >>> all_reduce_table(strategy, sizes=[4096, 1 << 20], iterations=20)
    >>> matmul_throughput(["/GPU:0"], size=None, iterations=10)      # n = 8192 on a GPU
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

EQUAL_TOL = 1e-5


def _timed(function, iterations: int) -> float:
    """Seconds per call of `function()` (which returns a tensor), after one warm-up call."""
    function().numpy()
    started = time.perf_counter()
    for _ in range(iterations - 1):
        function()
    function().numpy()
    return (time.perf_counter() - started) / iterations


def all_reduce_table(strategy, sizes: Sequence[int], iterations: int) -> list[dict]:
    """nccl-tests-like rows: size, time per all-reduce, algbw and busbw in GB/s."""
    import tensorflow as tf

    n = strategy.num_replicas_in_sync
    rows = []
    for size in sizes:
        count = max(1, size // 4)

        @tf.function
        def reduce(count=count):  # the payload is made on each replica's own device
            ctx = tf.distribute.get_replica_context
            return strategy.run(lambda: ctx().all_reduce(tf.distribute.ReduceOp.SUM,
                                                         tf.fill([count], 1.0)))

        def step(reduce=reduce):
            return strategy.experimental_local_results(reduce())[0][:1]

        seconds = _timed(step, iterations)
        algbw = count * 4 / seconds / 1e9
        rows.append({"bytes": count * 4, "time_us": seconds * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (n - 1) / n if n > 1 else 0.0})
    return rows


def matmul_throughput(device_names: Sequence[str], size: int | None, iterations: int) -> list[dict]:
    """TFLOP/s of an n x n matmul per device, each row labelled with the math it measures.

    On a GPU where TF32 applies (compute capability 8.0 and newer, TensorFlow's default
    on), float32 is timed twice: with TF32 math as TensorFlow runs it, and with TF32 off
    for that row (true float32). `size` None: 8192 on a GPU or TPU, 2048 on a CPU.

    Example:
        >>> [r["math"] for r in matmul_throughput(["/cpu:0"], 128, 10)]
        ['float32', 'bfloat16']
    """
    rows = []
    for name in device_names:
        n = size or (2048 if "CPU" in name.upper() else 8192)
        for dtype, math, tf32 in _matmul_rows(name):
            row = _matmul_row(name, n, dtype, tf32, iterations)
            rows.append({"device": name, "dtype": dtype.name, "math": math, **row})
    return rows


def _matmul_row(device: str, n: int, dtype, tf32: bool | None, iterations: int) -> dict:
    """One row; n halves while the device is out of memory (a 1 GiB logical GPU: n = 4096)."""
    import tensorflow as tf

    try:
        with tf.device(device), _tf32(tf32):
            a = tf.cast(tf.random.normal([n, n], dtype=tf.float32), dtype)
            multiply = tf.function(lambda a=a: tf.reduce_sum(tf.matmul(a, a)[:1, :1]))
            seconds = _timed(multiply, iterations)
    except tf.errors.ResourceExhaustedError:
        if n <= 1024:
            raise
        return _matmul_row(device, n // 2, dtype, tf32, iterations)
    return {"n": n, "iterations": iterations, "tflops": 2 * n ** 3 / seconds / 1e12}


def _matmul_rows(device: str) -> list[tuple[Any, str, bool | None]]:
    """(dtype, what the row measures, TF32 for the row: None keeps TensorFlow's setting)."""
    import tensorflow as tf

    if "GPU" in device.upper() and _tf32_applies():
        return [(tf.float32, "float32 (TF32 math: TensorFlow's default on this GPU)", None),
                (tf.float32, "float32 (TF32 off for this row)", False),
                (tf.bfloat16, "bfloat16", None)]
    return [(tf.float32, "float32", None), (tf.bfloat16, "bfloat16", None)]


def _tf32_applies() -> bool:
    """TF32 is on and a GPU has tensor cores for it (compute capability 8.0 and newer)."""
    import tensorflow as tf

    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    details = tf.config.experimental.get_device_details
    return any(tuple(details(gpu).get("compute_capability") or (0, 0)) >= (8, 0)
               for gpu in tf.config.list_physical_devices("GPU"))


@contextlib.contextmanager
def _tf32(enabled: bool | None):
    """TF32 on or off inside the block (None: as it is), restored after."""
    import tensorflow as tf

    before = tf.config.experimental.tensor_float_32_execution_enabled()
    if enabled is not None:
        tf.config.experimental.enable_tensor_float_32_execution(enabled)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


def fit_and_loop_step(strategy) -> dict:
    """One SGD step of a small GPT from the same weights, in Keras fit and in tfpar's loop."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar.loop import Trainer
    from tfpar.models import GPT

    kind = type(strategy).__name__
    if "ParameterServer" in kind:
        return {"skipped": "Keras fit does not run under parameter_server (keras#18624)"}
    batch = 2 * strategy.num_replicas_in_sync
    tokens = np.random.RandomState(0).randint(0, 64, size=(batch, 16)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((tokens, np.roll(tokens, -1, 1))).batch(batch)
    keras.utils.set_random_seed(0)
    weights = GPT(vocab_size=64, max_len=16, dim=32, depth=1, heads=2).get_weights()
    results = {}
    for mode in ("fit", "loop"):
        with strategy.scope():
            model = GPT(vocab_size=64, max_len=16, dim=32, depth=1, heads=2)
            model.set_weights(weights)
            optimizer = keras.optimizers.SGD(0.1)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        started = time.perf_counter()
        if mode == "fit":
            with strategy.scope():
                model.compile(optimizer=optimizer, loss=loss)
            model.fit(data, epochs=1, verbose=0, shuffle=False)
        else:
            Trainer(model, optimizer, loss, strategy=strategy).fit(
                strategy.experimental_distribute_dataset(data), steps=1)
        results[mode] = (model.get_weights(), time.perf_counter() - started)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(results["fit"][0], results["loop"][0]))
    return {"max_difference": difference, "equal": difference <= EQUAL_TOL,
            "fit_s": results["fit"][1], "loop_s": results["loop"][1]}
