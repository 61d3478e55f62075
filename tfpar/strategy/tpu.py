"""Find and initialise a TPU: a TPU VM (Colab, Kaggle, Cloud), an older Colab runtime, or a named TPU.

Example:
    >>> resolver = connect_tpu()          # raises TPUNotFoundError listing what it tried
    >>> strategy = tf.distribute.TPUStrategy(resolver)
"""

from __future__ import annotations

import glob
import os
from typing import Mapping

from tfpar.errors import TPUNotFoundError


def tpu_candidates(tpu: str | None = None, environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """Where a TPU could be, best first, as (tpu argument for the resolver, why).

    Empty when nothing on this machine points at a TPU, so `auto` never probes blindly
    (a probe without a TPU can wait on the network for minutes).
    """
    environ = os.environ if environ is None else environ
    if tpu:
        return [(tpu, f"tpu={tpu!r} was given")]
    found = []
    device_files = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    if device_files or environ.get("TPU_ACCELERATOR_TYPE") or environ.get("TPU_WORKER_ID"):
        found.append(("local", "this is a TPU VM (TPU device files or TPU_* variables)"))
    if environ.get("COLAB_TPU_ADDR"):
        found.append((f"grpc://{environ['COLAB_TPU_ADDR']}", "COLAB_TPU_ADDR is set"))
    if environ.get("TPU_NAME"):
        found.append((environ["TPU_NAME"], "TPU_NAME is set"))
    return found


def connect_tpu(tpu: str | None = None, environ: Mapping[str, str] | None = None):
    """Connects to and initialises the first TPU that answers; returns its resolver."""
    import tensorflow as tf

    tried = []
    for name, why in tpu_candidates(tpu, environ):
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
            if name != "local":
                tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            if not tf.config.list_logical_devices("TPU"):
                raise RuntimeError("initialised, but no TPU devices are visible")
            return resolver
        except Exception as e:  # pylint: disable=broad-except
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            tried.append(f"TPUClusterResolver(tpu={name!r}) because {why}: {first_line}")
    if not tried:
        tried = [
            "tpu='local' (TPU VM): no /dev/accel* or /dev/vfio devices and no TPU_* variables",
            "COLAB_TPU_ADDR (older Colab TPU runtime): not set",
            "TPU_NAME (named Cloud TPU): not set",
        ]
    raise TPUNotFoundError(
        "No TPU found. Tried:\n  - " + "\n  - ".join(tried) + "\n"
        "On Colab choose Runtime > Change runtime type > TPU; on a Cloud TPU VM run on the VM "
        "itself; for a remote TPU pass tpu='NAME' (or set TPU_NAME). To run without a TPU use "
        "create_strategy('auto')."
    )
