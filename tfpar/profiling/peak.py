"""FLOPs of a training step and the peak they are measured against (MFU).

The peak: a GPU's or TPU's datasheet rate for the run's math (dense, per chip; float32
on a GPU with TF32 is TF32's rate, TensorFlow's default there), or on a CPU the matmul
rate measured now, as `tfpar-check` measures it.

Example:
    >>> flops = step_flops(model, x, replicas=2)       # forward + backward, per worker
    >>> peak, source = device_peak("/cpu:0", "float32")
    >>> mfu = flops / seconds_per_step / peak
"""

from __future__ import annotations

import os
import re

from absl import logging

# Dense TFLOP/s per chip: (float32 as TensorFlow runs it, bfloat16/float16).
DATASHEET_TFLOPS = {
    "H200": (494.7, 989.4), "H100": (494.7, 989.4), "A100": (156.0, 312.0), "L40S": (183.0, 362.0),
    "L4": (60.0, 121.0), "A10": (62.5, 125.0), "V100": (15.7, 125.0), "T4": (8.1, 65.0),
    "TPU v6": (918.0, 918.0), "TPU v5p": (459.0, 459.0), "TPU v5": (197.0, 197.0),
    "TPU v4": (275.0, 275.0), "TPU v3": (123.0, 123.0), "TPU v2": (45.0, 45.0),
}


def datasheet_peak(device_description: str, precision: str) -> float | None:
    """FLOP/s from DATASHEET_TFLOPS for a device whose description names a known chip."""
    text = device_description.upper()
    for name, (fp32, half) in sorted(DATASHEET_TFLOPS.items(), key=lambda item: -len(item[0])):
        if name.upper() in text:
            return (fp32 if precision == "float32" else half) * 1e12
    return None


def tpu_chip(accelerator_type: str) -> str | None:
    """A TPU VM's accelerator type (its `TPU_ACCELERATOR_TYPE`, e.g. "v5litepod-8") as a
    DATASHEET_TFLOPS name.

    Example:
        >>> tpu_chip("v5litepod-8"), tpu_chip("v5p-16"), tpu_chip("v4-8")
        ('TPU v5', 'TPU v5p', 'TPU v4')
    """
    found = re.match(r"v(\d)(p|e|lite)?", accelerator_type.strip().lower())
    if not found:
        return None
    return f"TPU v{found.group(1)}" + ("p" if found.group(2) == "p" else "")


def _description(device: str) -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    kind = "TPU" if "TPU" in device.upper() else "GPU" if "GPU" in device.upper() else "CPU"
    if kind == "TPU":  # TensorFlow's TPU devices do not name the chip; the TPU VM does
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("ACCELERATOR_TYPE") or ""
        return f"{device} {tpu_chip(accelerator) or accelerator}"
    physical = tf.config.list_physical_devices(kind)
    if not physical:
        return device
    details = tf.config.experimental.get_device_details(physical[0]) if kind == "GPU" else {}
    return f"{device} {details.get('device_name', '')} {physical[0].name}"


def device_peak(device: str, precision: str = "float32") -> tuple[float | None, str]:
    """(FLOP/s, where it came from) of one device for `precision` ("float32" or a mixed one)."""
    description = _description(device)
    found = datasheet_peak(description, precision)
    if found:
        return found, f"datasheet, {description.strip()}"
    if "CPU" not in device.upper():
        return None, f"no datasheet rate for {description.strip()}"
    from tfpar.check_probes import matmul_throughput  # pylint: disable=import-outside-toplevel

    rows = matmul_throughput([device], 1024, 5)
    math = "float32" if precision == "float32" else "bfloat16"
    rate = next(r["tflops"] for r in rows if r["math"] == math) * 1e12
    return rate, f"{math} matmul measured now on {device}, as tfpar-check"


def step_flops(model, x, replicas: int = 1, passes: int = 1) -> float | None:
    """Forward + backward FLOPs of one optimizer step on one worker: `x` is one replica's
    (micro-)batch, run `passes` times a step (accumulation x pipeline micro-batches); None
    where the model's stages cannot be counted."""
    from tensorflow.python.util import deprecation  # pylint: disable=import-outside-toplevel

    from tfpar.placement import costs  # pylint: disable=import-outside-toplevel

    try:
        with deprecation.silence():
            counted = sum(costs.flops(model, x).values())
    except Exception as error:  # pylint: disable=broad-except  (a model without tfpar's stages)
        logging.warning("tfpar: FLOPs not counted for %s: %s", getattr(model, "name", model), error)
        return None
    return counted * replicas * passes
